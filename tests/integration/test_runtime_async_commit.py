"""The ingest's commit does not wait for its WAL flush (store.py, queries.sql `lock_room`): the
setting holds for the ingest's own transaction, one pipeline Sync, and no longer."""

from __future__ import annotations

import psycopg
from psycopg import AsyncRawCursor

from parley_runtime.store import Q
from support import SessionEnv


async def test_the_lock_statement_turns_off_synchronous_commit_for_its_transaction_only(
    test_env: SessionEnv,
) -> None:
    async with await psycopg.AsyncConnection.connect(test_env.database_url, autocommit=True) as conn:
        inside = AsyncRawCursor(conn)
        async with conn.pipeline():
            await conn.execute(Q["lock_room"], {"lock_key": "agent:room"}, prepare=True)
            await inside.execute("SELECT current_setting('synchronous_commit')")
        assert await inside.fetchone() == ("off",)
        after = await conn.execute("SELECT current_setting('synchronous_commit')")
        assert await after.fetchone() == ("on",)
        # The room's lock went with that transaction: another session takes it at once.
        async with await psycopg.AsyncConnection.connect(test_env.database_url, autocommit=True) as other:
            taken = await other.execute("SELECT pg_try_advisory_lock(hashtextextended('agent:room', 0))")
            assert await taken.fetchone() == (True,)
