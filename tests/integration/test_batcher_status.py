"""The batcher's status counts the sections still to deliver, reading only those (gateway migration
0002): a delivered section stays until its owner disposes of it, and the count read every one of
them at each drain of its affinity and each gauge refresh. Against a real PostgreSQL, with the
plans it ran."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from prometheus_client import CollectorRegistry

from parley_gateway.batcher import Batcher
from parley_gateway.batching import BatcherConfig
from parley_gateway.engine import GatewayMetrics
from parley_gateway.store import MIGRATIONS_DIR, SCHEMA, GatewayStore, Q
from support import explain, migrated, plan_nodes

DELIVERED = 3000


@pytest.fixture
async def store(fresh_database: str) -> AsyncIterator[GatewayStore]:
    async with migrated(fresh_database, SCHEMA, MIGRATIONS_DIR, "batcher-status", max_size=2) as db:
        yield GatewayStore(db)


async def sections(store: GatewayStore, affinity: str, state: str, n: int, *, recurring_ms: int = 0) -> None:
    await store.db.execute(
        """INSERT INTO model.batch_section (agent_id, id, affinity, spec, frequency, min_cycle_ms, state,
                                            drain_seq)
           SELECT 'agent-1', %(affinity)s || '-' || %(state)s || '-' || i, %(affinity)s, '{}'::jsonb,
                  CASE WHEN %(recurring_ms)s > 0 THEN 'recurring' ELSE 'once' END, %(recurring_ms)s,
                  %(state)s, CASE WHEN %(state)s = 'draining' THEN 7 END
             FROM generate_series(1, %(n)s) AS i""",
        {"affinity": affinity, "state": state, "n": n, "recurring_ms": recurring_ms},
        what="sections",
    )


async def test_the_status_counts_the_sections_to_deliver_without_reading_the_delivered(
    store: GatewayStore,
) -> None:
    # A busy affinity: thousands delivered, a few still to deliver. One whose sections were all
    # delivered, one drained whose sections were all disposed of, one never drained. Listed: the
    # affinities with sections to deliver, and any affinity asked for by name.
    await sections(store, "room:busy", "delivered", DELIVERED)
    await sections(store, "room:busy", "pending", 3)
    await sections(store, "room:busy", "draining", 1, recurring_ms=60_000)
    await sections(store, "room:done", "delivered", DELIVERED)
    await sections(store, "room:new", "pending", 2)
    await store.db.execute(
        """INSERT INTO model.batch_affinity
                  (affinity, drain_seq, draining_until, holder, drains, last_drain_at)
           VALUES ('room:busy', 7, now() + interval '1 minute', 'me', 6, now() - interval '1 second'),
                  ('room:done', 2, NULL, NULL, 2, now() - interval '1 hour'),
                  ('room:gone', 1, NULL, NULL, 1, now() - interval '1 day')""",
        what="affinities",
    )
    # Every room that ever had a section drained has its row: thousands, none with sections left.
    await store.db.execute(
        """INSERT INTO model.batch_affinity (affinity, drain_seq, drains, last_drain_at)
           SELECT 'room:old-' || i, 1, 1, now() - interval '1 day' FROM generate_series(1, %(n)s) AS i""",
        {"n": DELIVERED},
        what="old affinities",
    )
    await store.db.execute("ANALYZE model.batch_section", what="analyze")
    await store.db.execute("ANALYZE model.batch_affinity", what="analyze")

    status = await store.batcher_status("")
    assert [(s.affinity, s.pending, s.sections, s.min_cycle_ms, s.drains, s.draining) for s in status] == [
        ("room:busy", 3, 4, 60_000, 6, True),
        ("room:new", 2, 2, None, 0, False),
    ]
    busy, new = status
    assert busy.last_drain_at is not None
    assert 0 <= (busy.since_last_drain_ms or -1) < 60_000
    assert (new.last_drain_at, new.since_last_drain_ms) == (None, None)
    # Asked by name, an affinity with nothing left to deliver still tells its drains.
    assert [(s.affinity, s.sections) for s in await store.batcher_status("room:busy")] == [("room:busy", 4)]
    (done,) = await store.batcher_status("room:done")
    assert (done.affinity, done.pending, done.sections, done.min_cycle_ms, done.drains) == (
        "room:done",
        0,
        0,
        None,
        2,
    )
    assert (done.since_last_drain_ms or -1) >= 3_500_000
    assert [(s.affinity, s.drains) for s in await store.batcher_status("room:gone")] == [("room:gone", 1)]
    assert await store.batcher_status("room:unknown") == []

    # As PostgreSQL runs it, for one affinity and for all, with custom and generic plans: the
    # sections read are the ones still to deliver (6), none of the 6,000 delivered.
    for affinity in ("", "room:busy", "room:done", "room:gone"):
        for mode in ("force_custom_plan", "force_generic_plan"):
            plan = await explain(store.db, Q["batcher_status"], {"affinity": affinity}, plan_cache_mode=mode)
            read = sum(
                (n["Actual Rows"] + n.get("Rows Removed by Filter", 0)) * n["Actual Loops"]
                for n in plan_nodes(plan)
                if n.get("Relation Name") == "batch_section"
            )
            assert read <= 6, (affinity, mode, read, plan)
            # and of the affinities' rows, the ones of those sections (or the one asked for)
            read = sum(
                (n["Actual Rows"] + n.get("Rows Removed by Filter", 0)) * n["Actual Loops"]
                for n in plan_nodes(plan)
                if n.get("Relation Name") == "batch_affinity"
            )
            assert read <= 3, (affinity, mode, read, plan)


async def test_the_pending_gauge_of_an_affinity_with_nothing_left_falls_to_zero(store: GatewayStore) -> None:
    registry = CollectorRegistry()
    metrics = GatewayMetrics(registry)
    batcher = Batcher(
        store=store,
        engine=None,  # type: ignore[arg-type]  # refresh_gauges reads the store only
        bus=None,  # type: ignore[arg-type]
        config=BatcherConfig(),
        metrics=metrics,
        holder="gauges",
        lease_seconds=5,
    )
    await sections(store, "room:a", "pending", 2)
    await sections(store, "room:b", "pending", 1)
    await sections(store, "autonomy", "pending", 4)

    def gauge(label: str) -> float | None:
        return registry.get_sample_value("parley_batcher_sections", {"affinity": label})

    await batcher.refresh_gauges()
    assert (gauge("room"), gauge("autonomy")) == (3, 4)
    await store.db.execute(
        "UPDATE model.batch_section SET state = 'delivered' WHERE affinity LIKE 'room:%%'", what="deliver"
    )
    await batcher.refresh_gauges()
    assert (gauge("room"), gauge("autonomy")) == (0, 4)
