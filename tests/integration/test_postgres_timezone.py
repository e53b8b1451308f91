"""A ``Database``'s connections read timestamps in Python's own UTC, whatever the server's zone: psycopg
reads a zone like ``Etc/UTC`` as a ``ZoneInfo``, whose datetimes convert about three times slower."""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator
from datetime import UTC, datetime

import psycopg
import pytest

from parley_platform.postgres import Database
from support import SessionEnv


@pytest.fixture
async def db(test_env: SessionEnv) -> AsyncIterator[Database]:
    database = Database(test_env.database_url, name=f"tz-{secrets.token_hex(3)}", min_size=1, max_size=2)
    await database.open()
    yield database
    await database.close()


async def test_timestamps_come_back_in_pythons_own_utc_whatever_the_servers_zone(
    test_env: SessionEnv, db: Database
) -> None:
    async with await psycopg.AsyncConnection.connect(test_env.database_url, autocommit=True) as plain:
        server_zone = (await (await plain.execute("SHOW TimeZone")).fetchone() or [""])[0]
        plain_now = (await (await plain.execute("SELECT now()")).fetchone() or [None])[0]
    row = await db.fetchone(
        "SELECT now() AS at, '2026-01-02 03:04:05+02'::timestamptz AS fixed, "
        "current_setting('TimeZone') AS zone",
        {},
        what="timestamps",
    )
    assert row is not None
    assert row["zone"] == "UTC", f"the server's own zone is {server_zone}"
    assert row["at"].tzinfo is UTC
    assert row["fixed"].tzinfo is UTC
    assert row["fixed"] == datetime(2026, 1, 2, 1, 4, 5, tzinfo=UTC)
    # The same instant either way: only how Python holds it changes.
    assert plain_now is not None
    assert abs((row["at"] - plain_now).total_seconds()) < 60
