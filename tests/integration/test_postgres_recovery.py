"""A service's pool is back within seconds of PostgreSQL after a long outage, against a real
PostgreSQL behind a TCP proxy that is taken away (connections cut, new ones refused) and brought
back on the same port.

psycopg_pool retries a lost connection with a delay that doubles from 1 s until its
``reconnect_timeout``; at its default (5 minutes) the attempts after a 35 s outage come about 31 s
and 63 s after the first failure, so a pool stayed without a connection (and its service
NOT_SERVING) for about as long again as the outage had lasted. ``Database`` gives up a slot's
retries after ``RECONNECT_TIMEOUT`` instead, and the host's probe, asking for a connection every
``PROBE_INTERVAL``, starts a fresh attempt with a short first delay.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from parley_devinfra.proxy import TcpProxy
from parley_platform.errors import ParleyError
from parley_platform.host import PROBE_INTERVAL, PROBE_TIMEOUT
from parley_platform.postgres import Database
from support import SessionEnv

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

OUTAGE = 35.0  # long enough that psycopg_pool's default backoff waits ~28 s past its end
BACK_WITHIN = 15.0  # the longest wait of a fresh attempt (10 s) plus a probe interval, with room


async def probe(db: Database) -> bool:
    """What the host's probe does: one ``SELECT 1``, waiting at most PROBE_TIMEOUT for a connection."""
    try:
        await db.ping(PROBE_TIMEOUT)
    except ParleyError:
        return False
    return True


async def test_a_pool_is_back_within_seconds_after_a_long_outage(test_env: SessionEnv) -> None:
    upstream = int(conninfo_to_dict(test_env.database_url)["port"] or 5432)
    proxy = TcpProxy(upstream)
    port = await proxy.start()
    db = Database(make_conninfo(test_env.database_url, host="127.0.0.1", port=str(port)), name="recovery")
    await db.open()
    try:
        assert await probe(db)
        await proxy.stop()  # PostgreSQL unreachable: open connections cut, new ones refused
        started = time.monotonic()
        answered = 0
        while time.monotonic() - started < OUTAGE:
            answered += await probe(db)
            await asyncio.sleep(PROBE_INTERVAL)
        assert answered == 0, "a probe was answered while PostgreSQL was unreachable"

        await proxy.start(port)
        back = time.monotonic()
        while not await probe(db):
            assert time.monotonic() - back < 90, "the pool never reconnected"
            await asyncio.sleep(PROBE_INTERVAL)
        waited = time.monotonic() - back
        assert waited < BACK_WITHIN, f"the pool reconnected {waited:.1f} s after PostgreSQL was back"
    finally:
        with contextlib.suppress(Exception):
            await db.close()
        await proxy.stop()
