"""authz's gauges count what is live, reading only what is live: pending confirmations that expired
stay in their tables (a replay is recognised by its row), so a count keyed by creation read all of
them every 5 s (migration 0002 keys it by expiry); expired capability decisions nobody authorized
stayed forever (the sweeper now deletes them after their retention). Against a real PostgreSQL,
with the plans it ran."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import pytest

from parley_authz.store import MIGRATIONS_DIR, SCHEMA, AuthzStore, Q
from support import explain, migrated, plan_nodes

EXPIRED, RECENT, LIVE = 2000, 5, 3


@pytest.fixture
async def store(fresh_database: str) -> AsyncIterator[AuthzStore]:
    async with migrated(fresh_database, SCHEMA, MIGRATIONS_DIR, "gauges", max_size=2) as db:
        yield AuthzStore(db)


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

    plan = await explain(store.db, Q["gauges"])
    (scan,) = [n for n in plan_nodes(plan) if n.get("Relation Name") == "interaction_confirmation"]
    assert scan.get("Index Name") == "interaction_confirmation_pending", scan
    assert scan.get("Rows Removed by Filter", 0) == 0, scan
    assert scan["Actual Rows"] == LIVE, scan


async def test_live_decisions_are_counted_from_what_the_sweeper_leaves(store: AuthzStore) -> None:
    """Expired decisions nobody authorized stayed forever and the gauge read all of them; the
    sweeper deletes them after their retention (an hour by default), so it reads the live ones and
    the recently expired."""
    agent = uuid.uuid4()
    await store.db.execute(
        """INSERT INTO authz.capability_decision
                  (agent_id, decision_id, decision_digest, request_digest, outcome, account_id,
                   snapshot_version, capability, operation, risk, input_digest, issued_at, expires_at)
           SELECT %(agent)s, 'd' || i, repeat('a', 64), repeat('b', 64), 'allowed', 'acct', 'v1',
                  'mail.send', 'create', 'R1', repeat('c', 64), now() - interval '3 hours',
                  CASE WHEN i <= %(live)s THEN now() + interval '1 hour'
                       WHEN i <= %(live)s + %(recent)s THEN now() - interval '1 minute'
                       ELSE now() - interval '2 hours' END
             FROM generate_series(1, %(total)s) AS i""",
        {"agent": agent, "live": LIVE, "recent": RECENT, "total": EXPIRED + RECENT + LIVE},
        what="decisions",
    )
    assert await store.sweep_expired_decisions(3600, 100_000) == EXPIRED
    await store.db.execute("VACUUM ANALYZE authz.capability_decision", what="vacuum")

    gauges = {g.kind: g for g in await store.gauges()}
    assert gauges["capability_decision"].n == LIVE
    plan = await explain(store.db, Q["gauges"])
    (scan,) = [n for n in plan_nodes(plan) if n.get("Relation Name") == "capability_decision"]
    assert scan["Actual Rows"] + scan.get("Rows Removed by Filter", 0) == LIVE + RECENT, scan
