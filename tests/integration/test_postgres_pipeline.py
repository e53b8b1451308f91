"""``parley_platform.postgres.pipeline`` against a real PostgreSQL.

Through a TCP relay that counts the client's writes as the server's side of the socket receives
them: a pipeline's statements and its Sync arrive in one write (psycopg's own pipeline writes each
statement on its own). Connected directly: each cursor gets its own rows, a fetch inside the block
sends what is queued first, a failing statement rolls the pipeline back and leaves the connection
usable, a block that raises before sending runs none of its statements, and a pipeline larger than
libpq's buffer and the socket's completes."""

from __future__ import annotations

import asyncio
import secrets
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from contextlib import AbstractAsyncContextManager
from typing import Any

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from parley_platform.postgres import pipeline
from support import SessionEnv

pytestmark = pytest.mark.timeout(120)


# The relay runs in a process of its own, so it reads each write as it arrives (a thread would wait
# for the test's event loop to let go of the GIL, and read several writes at once). It forwards one
# connection both ways and answers each line on its stdin with the number of reads from the client.
RELAY = r"""
import select, socket, sys
host, port = sys.argv[1], int(sys.argv[2])
listener = socket.create_server(("127.0.0.1", 0))
print(listener.getsockname()[1], flush=True)
client, _ = listener.accept()
server = socket.create_connection((host, port))
for s in (client, server):
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
reads = 0
while True:
    for s in select.select([client, server, sys.stdin], [], [])[0]:
        if s is sys.stdin:
            if not sys.stdin.readline():
                sys.exit(0)
            print(reads, flush=True)
            continue
        data = s.recv(1 << 20)
        if not data:
            sys.exit(0)
        if s is client:
            reads += 1
            server.sendall(data)
        else:
            client.sendall(data)
"""


class Relay:
    """Counts the client's writes as the reads of a relay between it and the server: a write that
    fits the socket arrives as one read, and separate writes as separate reads unless the relay was
    slower than the client."""

    def __init__(self, host: str, port: int) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-c", RELAY, host, str(port)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.process.stdout is not None
        self.port = int(self.process.stdout.readline())

    @property
    def reads(self) -> int:
        assert self.process.stdin is not None
        assert self.process.stdout is not None
        self.process.stdin.write("\n")
        self.process.stdin.flush()
        return int(self.process.stdout.readline())

    def close(self) -> None:
        self.process.kill()
        self.process.communicate(timeout=5)


@pytest.fixture
def relay(test_env: SessionEnv) -> Iterator[tuple[Relay, str]]:
    params = conninfo_to_dict(test_env.database_url)
    host = str(params.get("host") or "")
    if not host or host.startswith("/"):
        pytest.skip("the test database is not reached over TCP")
    relay = Relay(host, int(params.get("port") or 5432))
    yield relay, make_conninfo(test_env.database_url, host="127.0.0.1", port=relay.port, sslmode="disable")
    relay.close()


@pytest.fixture
async def relayed(relay: tuple[Relay, str]) -> AsyncIterator[psycopg.AsyncConnection[Any]]:
    connection = await psycopg.AsyncConnection.connect(relay[1], autocommit=True)
    yield connection
    await connection.close()


@pytest.fixture
async def conn(test_env: SessionEnv) -> AsyncIterator[psycopg.AsyncConnection[Any]]:
    connection = await psycopg.AsyncConnection.connect(test_env.database_url, autocommit=True)
    yield connection
    await connection.close()


async def reads_of(
    relay: Relay, conn: psycopg.AsyncConnection[Any], block: AbstractAsyncContextManager[Any], n: int
) -> tuple[int, list[int]]:
    """The client's writes the relay read for a block of n statements, and the statements' rows."""
    await asyncio.sleep(0.1)  # what came before has been relayed
    before = relay.reads
    cursors = []
    async with block:
        for i in range(n):
            cursor = conn.cursor()
            await cursor.execute("SELECT %s::int * 2", (i,), prepare=True)
            cursors.append(cursor)
    rows = [(await cursor.fetchone() or (None,))[0] for cursor in cursors]
    await asyncio.sleep(0.1)
    return relay.reads - before, rows


async def test_a_pipelines_statements_and_its_sync_reach_the_server_in_one_write(
    relay: tuple[Relay, str], relayed: psycopg.AsyncConnection[Any]
) -> None:
    counter, conn = relay[0], relayed
    # Prepare the statement first, so both runs send the same messages (Bind and Execute).
    for _ in range(2):
        await reads_of(counter, conn, pipeline(conn), 20)
    # A relay slowed down by a busy machine reads several writes at once, or counts a late read of
    # what came before: such a try says nothing either way, and the pair is measured again. The
    # pipeline passes once the relay tells psycopg's writes apart (one per statement, the Sync, a
    # flush: the control) and, in the same try, ours arrive in one.
    tries = []
    for _ in range(5):
        plain, plain_rows = await reads_of(counter, conn, conn.pipeline(), 20)
        ours, rows = await reads_of(counter, conn, pipeline(conn), 20)
        assert rows == plain_rows == [2 * i for i in range(20)]
        tries.append((plain, ours))
        if plain >= 3 and ours == 1:
            break
    assert tries[-1][0] >= 3, f"the relay never told psycopg's writes apart: (plain, ours) = {tries}"
    assert tries[-1][1] == 1, f"(plain, ours) = {tries}"


async def test_a_fetch_inside_the_block_sends_what_is_queued_first(
    conn: psycopg.AsyncConnection[Any],
) -> None:
    async with asyncio.timeout(10), pipeline(conn):
        first = await conn.execute("SELECT 1", prepare=True)
        second = await conn.execute("SELECT 2", prepare=True)
        assert await second.fetchone() == (2,)
        third = await conn.execute("SELECT 3", prepare=True)
    assert await first.fetchone() == (1,)
    assert await third.fetchone() == (3,)


async def test_a_failing_statement_rolls_the_pipeline_back_and_the_connection_goes_on(
    conn: psycopg.AsyncConnection[Any],
) -> None:
    table = f"pipe_{secrets.token_hex(4)}"
    await conn.execute(f"CREATE TABLE {table} (id int PRIMARY KEY)")
    try:

        async def twice_the_same_key() -> None:
            async with pipeline(conn):
                await conn.execute(f"INSERT INTO {table} VALUES (1)")
                await conn.execute(f"INSERT INTO {table} VALUES (1)")
                await conn.execute(f"INSERT INTO {table} VALUES (2)")

        with pytest.raises(psycopg.errors.UniqueViolation):
            await twice_the_same_key()
        cur = await conn.execute(f"SELECT count(*) FROM {table}")
        assert await cur.fetchone() == (0,)
        async with pipeline(conn):
            await conn.execute(f"INSERT INTO {table} VALUES (3)")
        cur = await conn.execute(f"SELECT array_agg(id) FROM {table}")
        assert await cur.fetchone() == ([3],)
    finally:
        await conn.execute(f"DROP TABLE {table}")


async def test_a_pipeline_larger_than_the_buffers_completes(conn: psycopg.AsyncConnection[Any]) -> None:
    # 400 statements of 4 KB each, with results as large: past libpq's 64 KB and the sockets'.
    text = "x" * 4096
    cursors = []
    async with asyncio.timeout(30), pipeline(conn):
        for i in range(400):
            cursor = conn.cursor()
            await cursor.execute("SELECT %s::int, %s::text", (i, text), prepare=True)
            cursors.append(cursor)
    rows = [await cursor.fetchone() for cursor in cursors]
    assert rows == [(i, text) for i in range(400)]


async def test_a_block_that_raises_before_sending_runs_none_of_its_statements(
    conn: psycopg.AsyncConnection[Any],
) -> None:
    table = f"pipe_{secrets.token_hex(4)}"
    await conn.execute(f"CREATE TABLE {table} (id int PRIMARY KEY, note text)")
    insert = f"INSERT INTO {table} VALUES (%s, %s)"

    async def second_cannot_be_sent() -> None:
        async with pipeline(conn):
            await conn.execute(insert, (1, "one"), prepare=True)  # queued, with its Parse
            await conn.execute(insert, (2, "a\x00b"), prepare=True)  # fails in the client

    try:
        with pytest.raises(psycopg.DataError):
            await second_cannot_be_sent()
        cur = await conn.execute(f"SELECT count(*) FROM {table}")
        assert await cur.fetchone() == (0,)
        # The statement whose Parse was forgotten is prepared again when next used.
        async with pipeline(conn):
            await conn.execute(insert, (3, "three"), prepare=True)
        await conn.execute(insert, (4, "four"), prepare=True)
        cur = await conn.execute(f"SELECT array_agg(id ORDER BY id) FROM {table}")
        assert await cur.fetchone() == ([3, 4],)
    finally:
        await conn.execute(f"DROP TABLE {table}")
