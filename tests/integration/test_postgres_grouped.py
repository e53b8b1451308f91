"""``Database.fetchone_grouped`` against a real PostgreSQL: concurrent callers' statements commit
together, yet each caller gets what its statement alone would give; of many claims of one row
exactly one wins, from one process or two; a failing statement fails only its caller; a group whose
connection dies fails its callers with DB_UNAVAILABLE, and the next group runs."""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import AsyncIterator

import psycopg
import pytest

from parley_platform.errors import ParleyError
from parley_platform.postgres import Database
from support import SessionEnv

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
async def table(test_env: SessionEnv) -> AsyncIterator[str]:
    name = f"grouped_{secrets.token_hex(4)}"
    async with await psycopg.AsyncConnection.connect(test_env.database_url, autocommit=True) as conn:
        await conn.execute(
            f"CREATE TABLE {name} (id int PRIMARY KEY, n int NOT NULL DEFAULT 0, claimed_by text)"
        )
        await conn.execute(f"INSERT INTO {name} (id) SELECT g FROM generate_series(0, 99) g")
    yield name
    async with await psycopg.AsyncConnection.connect(test_env.database_url, autocommit=True) as conn:
        await conn.execute(f"DROP TABLE {name}")


@pytest.fixture
async def db(test_env: SessionEnv) -> AsyncIterator[Database]:
    database = Database(test_env.database_url, name=f"grouped-{secrets.token_hex(3)}", min_size=1, max_size=4)
    await database.open()
    yield database
    await database.close()


async def test_each_caller_gets_its_own_row_and_concurrent_callers_share_transactions(
    db: Database, table: str
) -> None:
    statement = (
        f"UPDATE {table} SET n = n + 1 WHERE id = %s RETURNING id, n, pg_current_xact_id()::text AS xact"
    )
    rows = await asyncio.gather(*(db.fetchone_grouped(statement, (i,)) for i in range(60)))
    assert [row["id"] for row in rows if row] == list(range(60))
    assert all(row is not None and row["n"] == 1 for row in rows)
    transactions = {row["xact"] for row in rows if row}
    # The first caller runs alone; the 59 that queued behind it go as groups of one transaction each.
    assert len(transactions) < 10, len(transactions)
    async with db.connection() as conn:
        cur = await conn.execute(f"SELECT sum(n) FROM {table}")
        assert (await cur.fetchone()) == (60,)


async def test_a_lone_caller_and_a_statement_without_a_row(db: Database, table: str) -> None:
    row = await db.fetchone_grouped(f"UPDATE {table} SET n = n + 1 WHERE id = %s RETURNING n", (5,))
    assert row == {"n": 1}
    assert (
        await db.fetchone_grouped(f"UPDATE {table} SET n = n + 1 WHERE id = %s RETURNING n", (500,)) is None
    )


@pytest.mark.parametrize("replicas", [1, 2])
async def test_of_many_claims_of_one_row_exactly_one_wins(
    test_env: SessionEnv, table: str, replicas: int
) -> None:
    databases = [
        Database(test_env.database_url, name=f"claims-{r}", min_size=1, max_size=4) for r in range(replicas)
    ]
    for database in databases:
        await database.open()
    try:
        claim = f"UPDATE {table} SET claimed_by = %s WHERE id = 7 AND claimed_by IS NULL RETURNING claimed_by"
        racers = [f"racer-{i}" for i in range(80)]
        rows = await asyncio.gather(
            *(databases[i % replicas].fetchone_grouped(claim, (racer,)) for i, racer in enumerate(racers))
        )
    finally:
        for database in databases:
            await database.close()
    winners = [row["claimed_by"] for row in rows if row is not None]
    assert len(winners) == 1, winners
    async with await psycopg.AsyncConnection.connect(test_env.database_url) as conn:
        cur = await conn.execute(f"SELECT claimed_by FROM {table} WHERE id = 7")
        assert (await cur.fetchone()) == (winners[0],)


async def test_a_failing_statement_fails_only_its_caller(db: Database, table: str) -> None:
    statement = f"UPDATE {table} SET n = n + %s::int WHERE id = %s RETURNING id, n"
    # Hold the pool's attention with one lone statement so the rest queue up as one group.
    first = asyncio.create_task(db.fetchone_grouped(f"SELECT pg_sleep(0.2), 1 AS x FROM {table} LIMIT 1"))
    await asyncio.sleep(0.05)
    calls = [db.fetchone_grouped(statement, ("1" if i != 4 else "not a number", i)) for i in range(10)]
    results = await asyncio.gather(*calls, return_exceptions=True)
    await first
    failed = [i for i, result in enumerate(results) if isinstance(result, BaseException)]
    assert failed == [4]
    error = results[4]
    assert isinstance(error, ParleyError)
    assert error.code == "CONSTRAINT_VIOLATION"
    # The group rolled back and ran again statement by statement: every other update happened once.
    async with db.connection() as conn:
        cur = await conn.execute(f"SELECT id, n FROM {table} WHERE id < 10 ORDER BY id")
        assert await cur.fetchall() == [(i, 0 if i == 4 else 1) for i in range(10)]


async def test_a_parameter_that_cannot_be_sent_fails_only_its_caller_and_each_claim_is_won_once(
    db: Database, table: str
) -> None:
    # A text with a NUL byte fails in the client, while its statement is being queued: the
    # statements queued before it must not run then and again on their own, or a claim they won
    # would be reported lost to its caller.
    statement = f"UPDATE {table} SET claimed_by = %s WHERE id = %s AND claimed_by IS NULL RETURNING id"
    first = asyncio.create_task(db.fetchone_grouped(f"SELECT pg_sleep(0.2), 1 AS x FROM {table} LIMIT 1"))
    await asyncio.sleep(0.05)
    calls = [db.fetchone_grouped(statement, ("a\x00b" if i == 3 else f"c{i}", 50 + i)) for i in range(8)]
    results = await asyncio.gather(*calls, return_exceptions=True)
    await first
    assert isinstance(results[3], ParleyError)
    assert [r for i, r in enumerate(results) if i != 3] == [{"id": 50 + i} for i in range(8) if i != 3]
    async with db.connection() as conn:
        cur = await conn.execute(f"SELECT id, claimed_by FROM {table} WHERE id BETWEEN 50 AND 57 ORDER BY id")
        assert await cur.fetchall() == [(50 + i, None if i == 3 else f"c{i}") for i in range(8)]


async def test_a_caller_that_gives_up_does_not_stop_the_others(db: Database, table: str) -> None:
    statement = f"UPDATE {table} SET n = n + 1 WHERE id = %s RETURNING n"
    first = asyncio.create_task(db.fetchone_grouped(f"SELECT pg_sleep(0.2), 1 AS x FROM {table} LIMIT 1"))
    await asyncio.sleep(0.05)
    tasks = [asyncio.create_task(db.fetchone_grouped(statement, (i,))) for i in range(20, 30)]
    await asyncio.sleep(0)
    tasks[3].cancel()
    done = await asyncio.gather(*tasks, return_exceptions=True)
    await first
    assert isinstance(done[3], asyncio.CancelledError)
    assert [d for i, d in enumerate(done) if i != 3] == [{"n": 1}] * 9
    assert await db.fetchone_grouped(statement, (40,)) == {"n": 1}  # groups still run afterwards


async def test_a_group_whose_connection_dies_fails_its_callers_as_unavailable(
    test_env: SessionEnv, table: str
) -> None:
    name = f"grouped-kill-{secrets.token_hex(3)}"
    db = Database(test_env.database_url, name=name, min_size=1, max_size=4)
    await db.open()
    try:
        first = asyncio.create_task(db.fetchone_grouped(f"SELECT pg_sleep(0.3), 1 AS x FROM {table} LIMIT 1"))
        await asyncio.sleep(0.05)
        # The next group: its first statement sleeps, and its backend is terminated meanwhile.
        group = [
            asyncio.create_task(db.fetchone_grouped("SELECT pg_sleep(2), 1 AS x")),
            *(
                asyncio.create_task(
                    db.fetchone_grouped(f"UPDATE {table} SET n = n + 1 WHERE id = %s RETURNING n", (i,))
                )
                for i in range(50, 55)
            ),
        ]
        await first
        async with await psycopg.AsyncConnection.connect(test_env.database_url, autocommit=True) as admin:
            killed = False
            for _ in range(500):  # up to 10 s for the group to reach its sleep
                cur = await admin.execute(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                    " WHERE application_name = %s AND query LIKE %s",
                    (name, "%pg_sleep(2)%"),
                )
                if await cur.fetchall():
                    killed = True
                    break
                await asyncio.sleep(0.02)
        assert killed, "the group's backend was never seen running its first statement"
        results = await asyncio.gather(*group, return_exceptions=True)
        assert all(isinstance(r, ParleyError) and r.code == "DB_UNAVAILABLE" for r in results), results
        # Nothing of the group committed, and the next group runs on a fresh connection.
        assert await db.fetchone_grouped(f"SELECT n FROM {table} WHERE id = %s", (50,)) == {"n": 0}
    finally:
        await db.close()
