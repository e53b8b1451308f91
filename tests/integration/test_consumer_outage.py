"""Outages are not poison, against real JetStream: a dependency that fails every attempt for
longer than max_deliver × backoff holds the message (no delivery spent, nothing dead-lettered),
pauses fetching, reports the missing dependency, and the message is handled once when it is back."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator

import pytest
from prometheus_client import CollectorRegistry

from parley_platform import codes
from parley_platform.bus import Bus, ConsumerSpec, StreamSpec
from parley_platform.consumer import Delivery, PullConsumer
from parley_platform.errors import ParleyError
from parley_platform.outage import Dependencies, mark_remote, outage_of
from parley_platform.testing import eventually


@pytest.fixture
async def lane(bus: Bus) -> AsyncIterator[tuple[str, str]]:
    tag = uuid.uuid4().hex[:12]
    name = f"{bus.subjects.ns.upper()}_OUTAGETEST_{tag.upper()}"
    prefix = f"{bus.subjects.ns}.outagetest.{tag}"
    await bus.ensure_stream(StreamSpec(name=name, subjects=[f"{prefix}.>"], max_age_seconds=600))
    yield name, prefix
    with contextlib.suppress(Exception):
        await bus.js.delete_stream(name)


def spec(stream: str, prefix: str, max_deliver: int = 3) -> ConsumerSpec:
    return ConsumerSpec(
        stream=stream,
        durable=f"d_{uuid.uuid4().hex[:10]}",
        filter_subject=f"{prefix}.>",
        ack_wait_seconds=2,
        max_deliver=max_deliver,
    )


async def dead_count(bus: Bus, stream: str) -> int:
    subject = bus.subjects.dead(stream)
    info = await bus.js.stream_info(bus.subjects.stream("DEAD"), subjects_filter=subject)
    return int((info.state.subjects or {}).get(subject, 0))


def test_failures_are_classified() -> None:
    assert outage_of(codes.DB_UNAVAILABLE("x")) == "postgres"
    assert outage_of(codes.DB_POOL_EXHAUSTED("x")) == "postgres"
    assert outage_of(codes.JETSTREAM_UNAVAILABLE("x")) == "nats"
    assert outage_of(mark_remote(codes.NO_RESPONDERS("model.Generate"), "model")) == "model"
    # A remote service's own outage (its database, its provider's open circuit) names the service.
    circuit = ParleyError.from_proto(codes.DEPENDENCY_UNAVAILABLE("circuit").to_proto())
    assert outage_of(mark_remote(circuit, "model")) == "model"
    # Not outages: a timeout (bounded retries), bad input, a bug, a remote's refusal.
    assert outage_of(mark_remote(codes.NATS_TIMEOUT("slow"), "model")) is None
    assert outage_of(mark_remote(codes.INVALID_ARGUMENT("bad"), "model")) is None
    assert outage_of(codes.INTERNAL("bug")) is None
    assert outage_of(RuntimeError("bug")) is None
    # The local NATS connection down is NATS, whichever service was called.
    assert outage_of(mark_remote(codes.NATS_UNAVAILABLE("down"), "pairing")) == "nats"


async def test_a_long_outage_holds_the_message_without_spending_deliveries(
    bus: Bus, lane: tuple[str, str]
) -> None:
    stream, prefix = lane
    registry = CollectorRegistry()
    dependencies = Dependencies(registry, known=("postgres",), probe_base=0.1, probe_cap=0.4)
    down = True
    attempts: list[tuple[int, int, str]] = []
    handled: list[str] = []

    async def handle(delivery: Delivery) -> None:
        attempts.append((delivery.num_delivered, delivery.retries, delivery.msg_id))
        if down:
            raise codes.DB_UNAVAILABLE("connection refused")
        handled.append(delivery.msg_id)

    consumer_spec = spec(stream, prefix, max_deliver=3)
    consumer = PullConsumer(
        bus,
        consumer_spec,
        handle,
        backoff_base=0.05,
        backoff_cap=0.2,
        fetch_timeout=0.3,
        dependencies=dependencies,
    )
    await consumer.start()
    try:
        await bus.publish(f"{prefix}.a", b"first", msg_id="first")

        def gauge() -> float | None:
            return registry.get_sample_value("parley_dependency_up", {"dependency": "postgres"})

        await eventually(lambda: asyncio.sleep(0, gauge() == 0), what="postgres reported down")
        await asyncio.sleep(0.5)  # a fetch already waiting when it went down has returned
        # Published while paused: not fetched (it could not be handled).
        await bus.publish(f"{prefix}.b", b"second", msg_id="second")
        # Far longer than max_deliver (3) × backoff (≤ 0.2 s) and ack_wait (2 s): the old
        # behaviour dead-letters within a second.
        await asyncio.sleep(5)
        assert dependencies.missing() == ["postgres"]
        assert registry.get_sample_value("parley_messages_held", {"stream": stream}) == 1
        assert {msg_id for _, _, msg_id in attempts} == {"first"}
        assert {n for n, _, _ in attempts} == {1}, "a held message spends no delivery"
        # Probes back off (0.1 s doubling to 0.4 s): about a dozen in 5 s, not a busy loop.
        assert 4 <= len(attempts) <= 30, len(attempts)
        info = await bus.js.consumer_info(stream, consumer_spec.durable)
        assert info.num_pending == 1  # "second" was never handed out

        started = time.monotonic()
        down = False
        await eventually(lambda: asyncio.sleep(0, len(handled) == 2), timeout=10, what="both handled")
        assert time.monotonic() - started < 3
        assert sorted(handled) == ["first", "second"]
        assert gauge() == 1
        assert dependencies.missing() == []
        assert registry.get_sample_value("parley_dependency_outages_total", {"dependency": "postgres"}) == 1

        async def settled() -> bool:
            info = await bus.js.consumer_info(stream, consumer_spec.durable)
            return bool(info.num_pending == 0 and info.num_ack_pending == 0)

        await eventually(settled, what="both acked")
        assert await dead_count(bus, stream) == 0
    finally:
        await consumer.stop(timeout=2)


async def test_an_own_failure_after_an_outage_still_spends_its_bounded_deliveries(
    bus: Bus, lane: tuple[str, str]
) -> None:
    """The dependency is back but the message keeps failing on its own: dead-lettered after
    max_deliver, as before (an outage does not make a message immortal)."""
    stream, prefix = lane
    dependencies = Dependencies(probe_base=0.05, probe_cap=0.1)
    calls = 0
    deliveries: list[int] = []

    async def handle(delivery: Delivery) -> None:
        nonlocal calls
        calls += 1
        deliveries.append(delivery.num_delivered)
        if calls <= 3:
            raise codes.DB_UNAVAILABLE("down")
        raise RuntimeError("broken on its own")

    consumer_spec = spec(stream, prefix, max_deliver=3)
    consumer = PullConsumer(
        bus,
        consumer_spec,
        handle,
        backoff_base=0.05,
        backoff_cap=0.1,
        fetch_timeout=0.3,
        dependencies=dependencies,
    )
    await consumer.start()
    try:
        await bus.publish(f"{prefix}.x", b"doomed", msg_id="doomed")
        await eventually(
            lambda: dead_count(bus, stream), timeout=15, what="dead-lettered for its own failure"
        )
        assert deliveries == [1, 1, 1, 1, 2, 3]
        assert dependencies.missing() == []
    finally:
        await consumer.stop(timeout=2)
