"""Migrations and the Postgres adapter against a real server: migrations build the declared
schema, apply once (also when replicas start at once), refuse edits and bad names; driver
errors are translated; named queries parse."""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import shutil
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from parley_authz import store as authz_store
from parley_devinfra.infra import free_port
from parley_gateway import store as gateway_store
from parley_pairing import store as pairing_store
from parley_platform.errors import Conflict, FailedPrecondition, Internal, InvalidArgument, Unavailable
from parley_platform.postgres import Database, describe_schema, load_queries, migrate
from parley_platform.testing import create_database, drop_database
from parley_runtime import store as runtime_store
from parley_scheduler import store as scheduler_store
from support import ROOT, SessionEnv

# (schema, migrations directory, declared schema.sql): add each service here.
SERVICES = [
    pytest.param(
        runtime_store.SCHEMA,
        runtime_store.MIGRATIONS_DIR,
        ROOT / "services/runtime/parley_runtime/sql/schema.sql",
        id="runtime",
    ),
    pytest.param(
        scheduler_store.SCHEMA,
        scheduler_store.MIGRATIONS_DIR,
        ROOT / "services/scheduler/parley_scheduler/sql/schema.sql",
        id="scheduler",
    ),
    pytest.param(
        pairing_store.SCHEMA,
        pairing_store.MIGRATIONS_DIR,
        ROOT / "services/pairing/parley_pairing/sql/schema.sql",
        id="pairing",
    ),
    pytest.param(
        authz_store.SCHEMA,
        authz_store.MIGRATIONS_DIR,
        ROOT / "services/authz/parley_authz/sql/schema.sql",
        id="authz",
    ),
    pytest.param(
        gateway_store.SCHEMA,
        gateway_store.MIGRATIONS_DIR,
        ROOT / "services/model_gateway/parley_gateway/sql/schema.sql",
        id="model",
    ),
]


@pytest.fixture
def second_database(test_env: SessionEnv) -> Iterator[str]:
    name = f"parley_fresh_{secrets.token_hex(4)}"
    url = create_database(test_env.server_database_url, name)
    yield url
    drop_database(test_env.server_database_url, name)


async def described(url: str, schema: str) -> list[str]:
    async with await psycopg.AsyncConnection.connect(url) as conn:
        return await describe_schema(conn, schema)


async def applied_versions(url: str, schema: str) -> list[tuple[int, str]]:
    async with await psycopg.AsyncConnection.connect(url) as conn:
        cur = await conn.execute(f"SELECT version, name FROM {schema}.schema_migrations ORDER BY version")
        return [(row[0], row[1]) for row in await cur.fetchall()]


def migration_files(directory: Path) -> list[str]:
    """The migration file names in version order."""
    return sorted((p.name for p in directory.glob("*.sql")), key=lambda name: int(name.split("_", 1)[0]))


@pytest.mark.parametrize(("schema", "migrations", "declared"), SERVICES)
async def test_migrations_build_the_declared_schema(
    fresh_database: str, second_database: str, schema: str, migrations: Path, declared: Path
) -> None:
    applied = await migrate(fresh_database, schema, migrations)
    assert applied == migration_files(migrations)

    async with await psycopg.AsyncConnection.connect(second_database, autocommit=True) as conn:
        await conn.execute(await asyncio.to_thread(declared.read_bytes))

    from_migrations = await described(fresh_database, schema)
    from_declared = await described(second_database, schema)
    assert any(line.startswith("column ") for line in from_migrations)
    assert any(line.startswith("index ") for line in from_migrations)
    assert from_migrations == from_declared


@pytest.mark.parametrize(("schema", "migrations", "declared"), SERVICES)
async def test_second_migrate_applies_nothing(
    fresh_database: str, schema: str, migrations: Path, declared: Path
) -> None:
    first = await migrate(fresh_database, schema, migrations)
    assert first
    before = await described(fresh_database, schema)
    assert await migrate(fresh_database, schema, migrations) == []
    assert await described(fresh_database, schema) == before
    assert [name for _, name in await applied_versions(fresh_database, schema)] == first


DEMO_SCHEMA = """
CREATE SCHEMA demo;
CREATE TYPE demo.mood AS ENUM ('calm', 'busy');
CREATE TABLE demo.item (
    id       bigint PRIMARY KEY,
    code     varchar(10) NOT NULL UNIQUE,
    price    numeric(10, 2),
    n        int DEFAULT 0,
    mood     demo.mood,
    created  timestamptz(3)
);
CREATE VIEW demo.item_counts AS SELECT id, n FROM demo.item;
"""

DRIFTS = {
    "added column": "ALTER TABLE demo.item ADD COLUMN extra text",
    "changed default": "ALTER TABLE demo.item ALTER COLUMN n SET DEFAULT 1",
    "dropped not null": "ALTER TABLE demo.item ALTER COLUMN code DROP NOT NULL",
    "varchar length": "ALTER TABLE demo.item ALTER COLUMN code TYPE varchar(20)",
    "numeric precision": "ALTER TABLE demo.item ALTER COLUMN price TYPE numeric(12, 4)",
    "timestamp precision": "ALTER TABLE demo.item ALTER COLUMN created TYPE timestamptz(6)",
    "identity": "ALTER TABLE demo.item ALTER COLUMN id ADD GENERATED ALWAYS AS IDENTITY",
    "added index": "CREATE INDEX item_n ON demo.item (n)",
    "added check": "ALTER TABLE demo.item ADD CONSTRAINT price_positive CHECK (price > 0)",
    "enum value": "ALTER TYPE demo.mood ADD VALUE 'sleepy'",
    "view definition": "CREATE OR REPLACE VIEW demo.item_counts AS SELECT id, n + 1 AS n FROM demo.item",
}


@pytest.mark.parametrize("drift", list(DRIFTS.values()), ids=list(DRIFTS))
async def test_describe_schema_notices_drift(fresh_database: str, second_database: str, drift: str) -> None:
    """The schema comparison above is only a proof if a difference makes it fail."""
    for url in (fresh_database, second_database):
        async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
            await conn.execute(DEMO_SCHEMA.encode())
    assert await described(fresh_database, "demo") == await described(second_database, "demo")
    async with await psycopg.AsyncConnection.connect(second_database, autocommit=True) as conn:
        await conn.execute(drift.encode())
    assert await described(fresh_database, "demo") != await described(second_database, "demo")


MIGRATE_CHILD = textwrap.dedent(
    """
    import asyncio, json, sys
    from pathlib import Path
    from parley_platform.postgres import migrate

    url, schema, directory = sys.argv[1:4]
    print("ready", flush=True)
    sys.stdin.readline()  # the barrier: every process has started and imported before any migrates
    applied = asyncio.run(migrate(url, schema, Path(directory)))
    print(json.dumps(applied), flush=True)
    """
)


@pytest.mark.parametrize(("schema", "migrations", "declared"), SERVICES)
async def test_concurrent_starts_apply_each_migration_once(
    fresh_database: str, schema: str, migrations: Path, declared: Path
) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    processes = [
        await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            MIGRATE_CHILD,
            fresh_database,
            schema,
            str(migrations),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=env,
        )
        for _ in range(4)
    ]
    try:
        async with asyncio.timeout(15):
            for proc in processes:
                assert proc.stdout is not None
                assert await proc.stdout.readline() == b"ready\n"
            for proc in processes:
                assert proc.stdin is not None
                proc.stdin.write(b"go\n")
                await proc.stdin.drain()
            results = [await proc.communicate() for proc in processes]
    finally:
        for proc in processes:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()

    applied: list[str] = []
    for proc, (out, err) in zip(processes, results, strict=True):
        assert proc.returncode == 0, err.decode()
        applied += json.loads(out.decode().strip().splitlines()[-1])
    assert sorted(applied) == sorted(migration_files(migrations))
    rows = await applied_versions(fresh_database, schema)
    assert [name for _, name in rows] == migration_files(migrations)


@pytest.fixture
def migrations_copy(tmp_path: Path) -> Path:
    target = tmp_path / "migrations"
    shutil.copytree(runtime_store.MIGRATIONS_DIR, target)
    return target


def edit_first_migration(directory: Path) -> str:
    first = sorted(directory.glob("*.sql"))[0]
    first.write_text(first.read_text() + "\n-- a harmless-looking edit\n")
    return first.name


async def test_edited_applied_migration_is_refused(fresh_database: str, migrations_copy: Path) -> None:
    assert await migrate(fresh_database, "runtime", migrations_copy)
    edited = edit_first_migration(migrations_copy)
    with pytest.raises(FailedPrecondition) as caught:
        await migrate(fresh_database, "runtime", migrations_copy)
    assert caught.value.code == "MIGRATION_CHANGED"
    assert edited in caught.value.message


@pytest.mark.parametrize(
    "bad_name", ["init.sql", "0002-add-things.sql", "0002_Add.sql", "0002_.sql", "v3_x.sql"]
)
async def test_badly_named_migration_is_invalid(fresh_database: str, tmp_path: Path, bad_name: str) -> None:
    (tmp_path / "0001_init.sql").write_text("CREATE TABLE demo.t (id int PRIMARY KEY);")
    (tmp_path / bad_name).write_text("SELECT 1;")
    with pytest.raises(FailedPrecondition) as caught:
        await migrate(fresh_database, "demo", tmp_path)
    assert caught.value.code == "MIGRATION_INVALID"
    assert bad_name in caught.value.message
    async with await psycopg.AsyncConnection.connect(fresh_database) as conn:
        cur = await conn.execute("SELECT count(*) FROM pg_namespace WHERE nspname = 'demo'")
        assert await cur.fetchone() == (0,), "nothing may be applied from an invalid directory"


async def test_duplicate_versions_are_invalid(fresh_database: str, tmp_path: Path) -> None:
    (tmp_path / "0001_a.sql").write_text("CREATE TABLE demo.a (id int);")
    (tmp_path / "1_b.sql").write_text("CREATE TABLE demo.b (id int);")
    with pytest.raises(FailedPrecondition) as caught:
        await migrate(fresh_database, "demo", tmp_path)
    assert caught.value.code == "MIGRATION_INVALID"


async def test_missing_migrations_directory_is_invalid(fresh_database: str, tmp_path: Path) -> None:
    """A wrong path (say, package data not installed) must not migrate to an empty schema."""
    with pytest.raises(FailedPrecondition) as caught:
        await migrate(fresh_database, "demo", tmp_path / "not-there")
    assert caught.value.code == "MIGRATION_INVALID"


async def test_migrations_apply_in_version_order(fresh_database: str, tmp_path: Path) -> None:
    # Names sort "10_" < "1_" < "2_" as text; versions must be applied as numbers.
    (tmp_path / "1_create.sql").write_text("CREATE TABLE demo.t (id int PRIMARY KEY);")
    (tmp_path / "2_add_name.sql").write_text("ALTER TABLE demo.t ADD COLUMN name text;")
    (tmp_path / "10_index_name.sql").write_text("CREATE INDEX t_name ON demo.t (name);")
    assert await migrate(fresh_database, "demo", tmp_path) == [
        "1_create.sql",
        "2_add_name.sql",
        "10_index_name.sql",
    ]
    assert await applied_versions(fresh_database, "demo") == [
        (1, "1_create.sql"),
        (2, "2_add_name.sql"),
        (10, "10_index_name.sql"),
    ]


async def test_failing_migration_applies_nothing(fresh_database: str, tmp_path: Path) -> None:
    (tmp_path / "0001_create.sql").write_text("CREATE TABLE demo.t (id int PRIMARY KEY);")
    (tmp_path / "0002_broken.sql").write_text("ALTER TABLE demo.nope ADD COLUMN x int;")
    with pytest.raises(Internal):
        await migrate(fresh_database, "demo", tmp_path)
    async with await psycopg.AsyncConnection.connect(fresh_database) as conn:
        cur = await conn.execute("SELECT to_regclass('demo.t') IS NULL")
        assert await cur.fetchone() == (True,)


async def test_invalid_schema_name_is_rejected(fresh_database: str, tmp_path: Path) -> None:
    with pytest.raises(InvalidArgument):
        await migrate(fresh_database, "demo; DROP DATABASE x", tmp_path)


async def test_database_translates_driver_errors(fresh_database: str) -> None:
    db = Database(fresh_database, name="test", min_size=1, max_size=2)
    await db.open(timeout=10)
    try:
        await db.execute("CREATE TABLE item (id int PRIMARY KEY, name text NOT NULL CHECK (name <> ''))")
        assert await db.execute("INSERT INTO item VALUES (%s, %s)", (1, "one")) == 1
        with pytest.raises(Conflict) as conflict:
            await db.execute("INSERT INTO item VALUES (%s, %s)", (1, "again"), what="insert item")
        assert conflict.value.code == "ALREADY_EXISTS"
        assert conflict.value.message.startswith("insert item")

        with pytest.raises(InvalidArgument) as check:
            await db.execute("INSERT INTO item VALUES (%s, %s)", (2, ""))
        assert check.value.code == "CONSTRAINT_VIOLATION"
        assert "item_name_check" in check.value.message
        with pytest.raises(InvalidArgument):
            await db.fetchone("SELECT %s::int", ("not a number",))
        with pytest.raises(Internal) as syntax:
            await db.fetchall("SELEKT nonsense")
        assert syntax.value.code == "DB_ERROR"

        # The pool is healthy after every failure.
        assert await db.fetchall("SELECT id, name FROM item ORDER BY id") == [{"id": 1, "name": "one"}]
        assert await db.fetchone("SELECT name FROM item WHERE id = %(id)s", {"id": 1}) == {"name": "one"}
        assert await db.fetchone("SELECT name FROM item WHERE id = %s", (99,)) is None
    finally:
        await db.close()


async def test_database_queries_may_contain_a_literal_percent(fresh_database: str) -> None:
    db = Database(fresh_database, name="test", min_size=1, max_size=1)
    await db.open(timeout=10)
    try:
        assert await db.fetchone("SELECT 'a' LIKE 'a%' AS matched") == {"matched": True}
        assert await db.fetchone("SELECT %s LIKE 'a%%' AS matched", ("abc",)) == {"matched": True}
    finally:
        await db.close()


async def test_unreachable_database_is_unavailable() -> None:
    url = f"postgresql://parley@127.0.0.1:{free_port()}/postgres"
    db = Database(url, name="test", min_size=1, max_size=1)
    try:
        with pytest.raises(Unavailable) as caught:
            await db.open(timeout=2)
        assert caught.value.code == "DB_UNAVAILABLE"
    finally:
        await db.close()


def test_load_queries_parses_named_headers(tmp_path: Path) -> None:
    path = tmp_path / "queries.sql"
    path.write_text(
        textwrap.dedent(
            """\
            -- Queries of the demo service; this preamble is not a query.

            -- fetch_item --
            -- Fetch one item by id.
            SELECT id, name
              FROM demo.item
             WHERE id = %(id)s;

            --   insert_item   --
            INSERT INTO demo.item (id, name) VALUES (%(id)s, %(name)s)
            RETURNING id;
            -- count_items --
            SELECT count(*) FROM demo.item -- trailing comments stay
            """
        )
    )
    queries = load_queries(path)
    assert list(queries) == ["fetch_item", "insert_item", "count_items"]
    assert queries["fetch_item"] == "SELECT id, name\n  FROM demo.item\n WHERE id = %(id)s"
    assert (
        queries["insert_item"] == "INSERT INTO demo.item (id, name) VALUES (%(id)s, %(name)s)\nRETURNING id"
    )
    assert queries["count_items"] == "SELECT count(*) FROM demo.item -- trailing comments stay"


def test_runtime_queries_all_parse() -> None:
    queries = load_queries(runtime_store.SQL_DIR / "queries.sql")
    assert queries
    assert all(body and not body.endswith(";") for body in queries.values())


def test_load_queries_refuses_a_duplicate_name(tmp_path: Path) -> None:
    path = tmp_path / "queries.sql"
    path.write_text("-- get_item --\nSELECT 1;\n\n-- get_item --\nSELECT 2;\n")
    with pytest.raises(FailedPrecondition) as caught:
        load_queries(path)
    assert "get_item" in caught.value.message
