"""The prompt batcher against real PostgreSQL and NATS, with the scripted model on the engine's real path:
drains serialised per affinity across replicas (raced, counted), packing, namespaced fields split
back, retries then fallback, duplicates, per-drain and recurring sections, dispose."""

from __future__ import annotations

import asyncio
import itertools
import secrets
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import psycopg
import pytest
from prometheus_client import CollectorRegistry

from parley.v1 import model_pb2
from parley_clients.batcher import result_subject
from parley_gateway.batcher import Batcher
from parley_gateway.batching import BatcherConfig, SchemaField, Section
from parley_gateway.engine import Budgets, Engine, GatewayMetrics, Ledger, Protected
from parley_gateway.protection import CircuitBreaker, Limiter, RetryPolicy
from parley_gateway.scripted import Rule, ScriptedEmbedder, ScriptedProvider
from parley_gateway.store import MIGRATIONS_DIR, SCHEMA, GatewayStore
from parley_platform.bus import Bus
from parley_platform.postgres import Database, migrate
from parley_platform.testing import eventually
from support import SessionEnv

RULES = [
    # Two sections packed together: the answer leaves out beta's field, so beta is retried alone.
    Rule(
        match=r"(?s)## Request alpha\b.*## Request beta\b", raw="<response><alpha__x>A</alpha__x></response>"
    ),
    Rule(match=r"(?s)## Request never\b", raw="<response></response>"),
    Rule(match=r"(?s)## Request digits\b", raw="<response><digits__n>twelve</digits__n></response>"),
    Rule(
        match=r"(?s)## Request escaped\b",
        raw="<response><escaped__v>a &lt;b&gt; &amp; c</escaped__v></response>",
    ),
]


@dataclass
class Replica:
    batcher: Batcher
    db: Database
    bus: Bus
    metrics: GatewayMetrics


@pytest.fixture
async def replicas(
    fresh_database: str, test_env: SessionEnv
) -> AsyncIterator[Callable[[int, BatcherConfig], asyncio.Future[list[Replica]]]]:
    await migrate(fresh_database, SCHEMA, MIGRATIONS_DIR)
    made: list[Replica] = []
    namespace = f"b{secrets.token_hex(4)}"

    async def make(count: int, config: BatcherConfig) -> list[Replica]:
        for index in range(count):
            db = Database(fresh_database, name=f"gw-{index}", min_size=1, max_size=4)
            await db.open()
            bus = await Bus.connect(test_env.nats_url, name=f"gw-{index}", namespace=namespace)
            store = GatewayStore(db)
            metrics = GatewayMetrics(CollectorRegistry())
            provider = ScriptedProvider(rules=RULES)
            protected = Protected(provider, Limiter("scripted", 16, 100), CircuitBreaker("scripted", 5, 10))
            engine = Engine(
                routes={t: protected for t in ("TEXT_SMALL", "TEXT_LARGE", "OBJECT_SMALL", "OBJECT_LARGE")},
                embedder=ScriptedEmbedder(),
                budgets=Budgets(store, default_tokens=0, window_seconds=60, cache_seconds=5),
                ledger=Ledger(store, 1.0),
                metrics=metrics,
                retry=RetryPolicy(attempts=1),
                provider_timeout=10,
                default_max_tokens=64,
            )
            batcher = Batcher(
                store=store,
                engine=engine,
                bus=bus,
                config=config,
                metrics=metrics,
                holder=f"replica-{index}",
                lease_seconds=30,
            )
            made.append(Replica(batcher, db, bus, metrics))
        return made[-count:]

    yield make  # type: ignore[misc]
    for replica in made:
        await replica.bus.close()
        await replica.db.close()


def section(
    id: str, *, agent: str = "agent-1", affinity: str = "default", fields: int = 1, **extra: object
) -> Section:
    return Section(
        id=id,
        agent_id=agent,
        affinity=affinity,
        prompt=f"Question {id}?",
        fields=tuple(SchemaField(f"f{i}") for i in range(fields)),
        **extra,  # type: ignore[arg-type]
    )


async def test_concurrent_drains_of_one_affinity_are_serialised_and_deliver_each_section_once(
    replicas: Callable[[int, BatcherConfig], asyncio.Future[list[Replica]]], fresh_database: str
) -> None:
    gateways = await replicas(4, BatcherConfig())
    for index in range(40):
        assert await gateways[index % 4].batcher.add(section(f"s{index}", agent=f"agent-{index % 3}"))
    heard: list[model_pb2.SectionResult] = []

    async def on_result(msg: object) -> None:
        heard.append(model_pb2.SectionResult.FromString(msg.data))  # type: ignore[attr-defined]

    listener = gateways[0].bus
    await listener.subscribe(result_subject(listener.subjects.ns, "*", "*"), on_result)

    # Eight drains at once, two from each replica, each on its own connection.
    drains = await asyncio.gather(*(gateways[i % 4].batcher.drain("default") for i in range(8)))
    delivered = [r.section_id for d in drains for r in d.results]
    assert sorted(delivered) == sorted(f"s{i}" for i in range(40))
    assert sum(1 for d in drains if d.sections) >= 1
    assert len({d.seq for d in drains}) == 8

    async with await psycopg.AsyncConnection.connect(fresh_database) as conn:
        cur = await conn.execute(
            "SELECT seq, started_at, finished_at FROM model.batch_drain"
            " WHERE affinity = 'default' ORDER BY seq"
        )
        log = await cur.fetchall()
        cur = await conn.execute("SELECT count(*) FROM model.batch_section WHERE state = 'delivered'")
        assert await cur.fetchone() == (40,)
    assert [row[0] for row in log] == sorted(d.seq for d in drains)
    for earlier, later in itertools.pairwise(log):
        assert earlier[2] <= later[1], f"drain {earlier[0]} overlapped drain {later[0]}"
    # Sections of different agents never share a call: 14, 13 and 13 one-field sections per agent,
    # at most 8 fields per call → 2 calls each.
    assert sum(d.calls for d in drains) == 6

    async def all_heard() -> bool:
        return sorted(r.section_id for r in heard) == sorted(delivered)

    await eventually(all_heard, what="every result published on NATS")


async def test_packing_respects_the_field_cap_isolation_and_priorities(
    replicas: Callable[[int, BatcherConfig], asyncio.Future[list[Replica]]],
) -> None:
    [gateway] = await replicas(1, BatcherConfig(max_sections_per_call=8))
    for index in range(10):
        await gateway.batcher.add(section(f"two{index}", fields=2))
    await gateway.batcher.add(section("alone", isolated=True))
    await gateway.batcher.add(section("urgent", priority="immediate"))
    drained = await gateway.batcher.drain("default")
    # 10 sections of 2 fields: 4 per call under the cap of 8 fields → 3 calls; +1 isolated, +1 immediate.
    assert drained.calls == 5
    assert drained.sections == 12
    by_id = {r.section_id: r for r in drained.results}
    assert dict(by_id["two3"].fields) == {"f0": "scripted", "f1": "scripted"}
    assert not any(r.fallback_used for r in drained.results)
    assert gateway.metrics.batcher_calls._value.get() == 5


async def test_a_missing_field_is_retried_alone_and_then_answered(
    replicas: Callable[[int, BatcherConfig], asyncio.Future[list[Replica]]],
) -> None:
    [gateway] = await replicas(1, BatcherConfig())
    await gateway.batcher.add(_named("alpha", "x", max_retries=1))
    await gateway.batcher.add(_named("beta", "y", max_retries=1))
    drained = await gateway.batcher.drain("default")
    by_id = {r.section_id: r for r in drained.results}
    assert (dict(by_id["alpha"].fields), by_id["alpha"].attempts) == ({"x": "A"}, 1)
    assert (dict(by_id["beta"].fields), by_id["beta"].attempts) == ({"y": "scripted"}, 2)
    assert not by_id["beta"].fallback_used
    assert drained.calls == 2


async def test_retries_run_out_then_the_fallback_is_used(
    replicas: Callable[[int, BatcherConfig], asyncio.Future[list[Replica]]],
) -> None:
    [gateway] = await replicas(1, BatcherConfig())
    # Isolated: each gets a call of its own, so each scripted answer reaches only its section.
    await gateway.batcher.add(_named("never", "v", max_retries=2, fallback={"v": "plan B"}, isolated=True))
    await gateway.batcher.add(_named("digits", "n", pattern=r"\d+", fallback={"n": "0"}, isolated=True))
    await gateway.batcher.add(_named("escaped", "v", isolated=True))
    drained = await gateway.batcher.drain("default")
    by_id = {r.section_id: r for r in drained.results}
    never = by_id["never"]
    assert (dict(never.fields), never.fallback_used, never.attempts) == ({"v": "plan B"}, True, 3)
    assert "missing field never__v" in never.error
    digits = by_id["digits"]
    assert (dict(digits.fields), digits.fallback_used) == ({"n": "0"}, True)
    assert "invalid field digits__n" in digits.error
    assert dict(by_id["escaped"].fields) == {"v": "a <b> & c"}


async def test_duplicates_per_drain_recurring_and_dispose(
    replicas: Callable[[int, BatcherConfig], asyncio.Future[list[Replica]]], fresh_database: str
) -> None:
    [gateway] = await replicas(1, BatcherConfig())
    batcher = gateway.batcher
    assert await batcher.add(section("every", frequency="per_drain", owner="me", affinity="autonomy"))
    assert not await batcher.add(section("every", frequency="per_drain", owner="me", affinity="autonomy"))
    assert await batcher.add(
        section("cycle", frequency="recurring", min_cycle_ms=3_600_000, owner="me", affinity="autonomy")
    )
    first = await batcher.drain("autonomy")
    assert sorted(r.section_id for r in first.results) == ["cycle", "every"]
    second = await batcher.drain("autonomy")
    assert [r.section_id for r in second.results] == ["every"]  # the recurring one is not due for an hour
    async with await psycopg.AsyncConnection.connect(fresh_database, autocommit=True) as conn:
        await conn.execute(
            "UPDATE model.batch_section SET last_run_at = now() - interval '2 hours' WHERE id = 'cycle'"
        )
    third = await batcher.drain("autonomy")
    assert sorted(r.section_id for r in third.results) == ["cycle", "every"]
    status = await batcher.store.batcher_status("autonomy")
    assert [(r.pending, r.drains, r.min_cycle_ms) for r in status] == [(2, 3, 3_600_000)]

    assert await batcher.store.dispose_sections("agent-1", [], "me") == 2
    assert (await batcher.drain("autonomy")).sections == 0
    assert await batcher.store.dispose_sections("agent-1", ["every"], "") == 0


async def test_a_provider_failure_falls_back_for_every_section_of_the_call(
    replicas: Callable[[int, BatcherConfig], asyncio.Future[list[Replica]]],
) -> None:
    [gateway] = await replicas(1, BatcherConfig())
    # Open the breaker: every call now fails fast with CIRCUIT_OPEN.
    protected = gateway.batcher.engine.route("TEXT_SMALL")
    for _ in range(5):
        protected.breaker.failure()
    await gateway.batcher.add(_named("one", "a", fallback={"a": "fa"}))
    await gateway.batcher.add(_named("two", "b", fallback={"b": "fb"}, max_retries=1))
    drained = await gateway.batcher.drain("default")
    by_id = {r.section_id: r for r in drained.results}
    assert dict(by_id["one"].fields) == {"a": "fa"}
    assert dict(by_id["two"].fields) == {"b": "fb"}
    assert by_id["two"].attempts == 2
    assert all(r.error.startswith("CIRCUIT_OPEN") for r in drained.results)


def _named(id: str, field: str, *, pattern: str = "", **extra: object) -> Section:
    return Section(
        id=id,
        agent_id="agent-1",
        affinity="default",
        prompt=f"Tell me {field}",
        fields=(SchemaField(field, pattern=pattern),),
        **extra,  # type: ignore[arg-type]
    )


async def test_a_drain_whose_lease_expired_is_taken_over_and_its_late_finish_changes_nothing(
    replicas: Callable[[int, BatcherConfig], asyncio.Future[list[Replica]]], fresh_database: str
) -> None:
    first, second = await replicas(2, BatcherConfig())
    for name in ("x", "y"):
        assert await first.batcher.add(section(name))
    # A drain that claimed the lease and both sections, then went silent (its replica died).
    dead = await first.batcher.store.claim_drain("default", "replica-0", 30)
    assert dead is not None
    assert sorted(s.id for s in dead.sections) == ["x", "y"]
    assert await second.batcher.store.claim_drain("default", "replica-1", 30) is None  # its lease is live
    async with await psycopg.AsyncConnection.connect(fresh_database, autocommit=True) as conn:
        await conn.execute(
            "UPDATE model.batch_affinity SET draining_until = now() - interval '1 second'"
            " WHERE affinity = 'default'"
        )
    taken = await second.batcher.drain("default")
    assert (taken.seq, sorted(r.section_id for r in taken.results)) == (dead.seq + 1, ["x", "y"])
    # The dead drain's finish, arriving late, neither overwrites the results nor logs a drain.
    late = {"fields": {"f0": "stale"}}
    assert await first.batcher.store.finish_drain(
        "default", dead, [("agent-1", "x", late), ("agent-1", "y", late)], calls=1
    ) == (0, False)
    async with await psycopg.AsyncConnection.connect(fresh_database) as conn:
        cur = await conn.execute(
            "SELECT id, state, deliveries, last_result->'fields'->>'f0' FROM model.batch_section ORDER BY id"
        )
        rows = await cur.fetchall()
        cur = await conn.execute("SELECT seq FROM model.batch_drain WHERE affinity = 'default'")
        logged = await cur.fetchall()
    assert [(r[0], r[1], r[2]) for r in rows] == [("x", "delivered", 1), ("y", "delivered", 1)]
    assert all(r[3] != "stale" for r in rows)
    assert logged == [(taken.seq,)]


async def test_a_drain_cut_off_during_its_call_gives_the_lease_back_and_the_next_delivers(
    replicas: Callable[[int, BatcherConfig], asyncio.Future[list[Replica]]],
) -> None:
    [gateway] = await replicas(1, BatcherConfig())
    batcher = gateway.batcher
    assert await batcher.add(section("slow"))
    provider = batcher.engine.route("TEXT_SMALL").provider
    assert isinstance(provider, ScriptedProvider)
    provider.latency_ms = 5_000
    cut = asyncio.create_task(batcher.drain("default"))

    async def calling() -> bool:
        return (await batcher.store.batcher_status("default"))[0].draining

    await eventually(calling, what="the drain holds the lease during its call")
    cut.cancel()
    with pytest.raises(asyncio.CancelledError):
        await cut
    [status] = await batcher.store.batcher_status("default")
    assert (status.draining, status.drains, status.pending) == (False, 1, 0)  # claimed, not delivered
    provider.latency_ms = 0
    again = await batcher.drain("default")
    assert [(r.section_id, r.fallback_used) for r in again.results] == [("slow", False)]
    [status] = await batcher.store.batcher_status("default")
    assert (status.draining, status.drains, status.sections) == (False, 2, 0)
