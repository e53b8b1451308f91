"""authz's gauges count what is live, reading only what is live (migration 0002): pending
confirmations that expired stay in their tables (a replay is recognised by its row), so a count
keyed by creation read all of them every 5 s. Against a real PostgreSQL, with the plan it ran."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest

from parley_authz.store import MIGRATIONS_DIR, SCHEMA, AuthzStore, Q
from parley_platform.postgres import Database, migrate

EXPIRED, LIVE = 2000, 3


@pytest.fixture
async def store(fresh_database: str) -> AsyncIterator[AuthzStore]:
    await migrate(fresh_database, SCHEMA, MIGRATIONS_DIR)
    db = Database(fresh_database, name="gauges", min_size=1, max_size=2)
    await db.open()
    yield AuthzStore(db)
    await db.close()


def nodes(plan: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield plan
    for child in plan.get("Plans", []):
        yield from nodes(child)


async def test_pending_confirmations_are_counted_from_the_live_ones_only(store: AuthzStore) -> None:
    agent = uuid.uuid4()
    await store.db.execute(
        """INSERT INTO authz.interaction_confirmation (agent_id, confirmation_id, action_digest, created_at,
                                                      expires_at)
           SELECT %(agent)s, 'c' || i, repeat('a', 64), now() - interval '2 hours',
                  CASE WHEN i <= %(live)s THEN now() + interval '1 hour' ELSE now() - interval '1 hour' END
             FROM generate_series(1, %(total)s) AS i""",
        {"agent": agent, "live": LIVE, "total": EXPIRED + LIVE},
        what="confirmations",
    )
    await store.db.execute("ANALYZE authz.interaction_confirmation", what="analyze")

    gauges = {g.kind: g for g in await store.gauges()}
    assert gauges["interaction_confirmation"].n == LIVE
    assert gauges["interaction_confirmation"].oldest_seconds >= 7200 - 60

    async with store.db.connection("explain") as conn:
        cursor = await conn.execute("EXPLAIN (ANALYZE, FORMAT JSON) " + Q["gauges"])
        row = await cursor.fetchone()
    assert row is not None
    document = row[0] if not isinstance(row, dict) else next(iter(row.values()))
    plan = (json.loads(document) if isinstance(document, str) else document)[0]["Plan"]
    (scan,) = [n for n in nodes(plan) if n.get("Relation Name") == "interaction_confirmation"]
    assert scan.get("Index Name") == "interaction_confirmation_pending", scan
    assert scan.get("Rows Removed by Filter", 0) == 0, scan
    assert scan["Actual Rows"] == LIVE, scan
