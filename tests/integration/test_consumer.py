"""The pull-consumer loop against real JetStream: ack, poison, retry with backoff,
max_deliver, garbage, cancellation on stop, bounded concurrency."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import pytest
from prometheus_client import CollectorRegistry

from parley_platform.bus import Bus, ConsumerSpec, StreamSpec, standard_streams
from parley_platform.consumer import (
    DEAD_DELIVERIES,
    DEAD_REASON,
    DEAD_STREAM,
    DEAD_SUBJECT,
    Delivery,
    Poison,
    PullConsumer,
)
from parley_platform.errors import Internal, InvalidArgument, NotFound, ParleyError, Unavailable
from parley_platform.metrics import MessagingMetrics
from parley_platform.testing import eventually
from support import SessionEnv


@dataclass
class Lane:
    """A stream of the test's own, and how to find its dead letters in the session's DEAD stream."""

    bus: Bus
    stream: str
    subject_prefix: str

    def subject(self, leaf: str = "msg") -> str:
        return f"{self.subject_prefix}.{leaf}"

    @property
    def dead_subject(self) -> str:
        return self.bus.subjects.dead(self.stream)

    def spec(self, **overrides: float) -> ConsumerSpec:
        values: dict[str, float] = {"ack_wait_seconds": 30, "max_deliver": 5, **overrides}
        return ConsumerSpec(
            stream=self.stream,
            durable=f"d_{uuid.uuid4().hex[:10]}",
            filter_subject=f"{self.subject_prefix}.>",
            ack_wait_seconds=values["ack_wait_seconds"],
            max_deliver=int(values["max_deliver"]),
        )

    async def dead_count(self) -> int:
        info = await self.bus.js.stream_info(
            self.bus.subjects.stream("DEAD"), subjects_filter=self.dead_subject
        )
        return int((info.state.subjects or {}).get(self.dead_subject, 0))

    async def dead_headers(self) -> dict[str, str]:
        msg = await self.bus.js.get_last_msg(self.bus.subjects.stream("DEAD"), self.dead_subject)
        return dict(msg.headers or {})

    async def settled(self, durable: str) -> bool:
        """Nothing pending, nothing waiting for an ack."""
        info = await self.bus.js.consumer_info(self.stream, durable)
        return bool(info.num_pending == 0 and info.num_ack_pending == 0)


@pytest.fixture
async def lane(bus: Bus) -> AsyncIterator[Lane]:
    tag = uuid.uuid4().hex[:12]
    name = f"{bus.subjects.ns.upper()}_CONSUMERTEST_{tag.upper()}"
    prefix = f"{bus.subjects.ns}.consumertest.{tag}"
    await bus.ensure_stream(StreamSpec(name=name, subjects=[f"{prefix}.>"], max_age_seconds=600))
    yield Lane(bus, name, prefix)
    with contextlib.suppress(Exception):
        await bus.js.delete_stream(name)


@contextlib.asynccontextmanager
async def running(consumer: PullConsumer) -> AsyncIterator[PullConsumer]:
    await consumer.start()
    try:
        yield consumer
    finally:
        await consumer.stop(timeout=2)


def recorder() -> tuple[list[Delivery], Callable[[Delivery], Awaitable[None]]]:
    seen: list[Delivery] = []

    async def handle(delivery: Delivery) -> None:
        seen.append(delivery)

    return seen, handle


async def test_handled_message_is_acked_once(bus: Bus, lane: Lane) -> None:
    seen, handle = recorder()
    spec = lane.spec()
    async with running(PullConsumer(bus, spec, handle, fetch_timeout=0.5)):
        assert await bus.publish(lane.subject(), b"hello", msg_id="m-1", headers={"X-Trace": "t1"})

        async def done() -> bool:
            return len(seen) == 1 and await lane.settled(spec.durable)

        await eventually(done, what="message handled and acked")
        info = await bus.js.consumer_info(lane.stream, spec.durable)
        assert info.num_redelivered == 0
        assert info.ack_floor.stream_seq == 1

    only = seen[0]
    assert (only.data, only.subject, only.msg_id, only.num_delivered) == (b"hello", lane.subject(), "m-1", 1)
    assert only.headers["X-Trace"] == "t1"
    assert len(seen) == 1
    assert await lane.dead_count() == 0


async def test_poison_is_dead_lettered_once_and_not_redelivered(bus: Bus, lane: Lane) -> None:
    calls: list[Delivery] = []

    async def handle(delivery: Delivery) -> None:
        calls.append(delivery)
        raise Poison("payload is not a greeting", label="invalid")

    spec = lane.spec()
    async with running(PullConsumer(bus, spec, handle, fetch_timeout=0.5)):
        await bus.publish(lane.subject("poison"), b"\x00garbage", msg_id="poison-1")

        async def dead_and_settled() -> bool:
            return await lane.dead_count() == 1 and await lane.settled(spec.durable)

        await eventually(dead_and_settled, what="poison dead-lettered and terminated")
        info = await bus.js.consumer_info(lane.stream, spec.durable)
        assert info.num_redelivered == 0

    assert len(calls) == 1
    assert await lane.dead_count() == 1
    dead = await bus.js.get_last_msg(bus.subjects.stream("DEAD"), lane.dead_subject)
    assert dead.data == b"\x00garbage"
    headers = dict(dead.headers or {})
    assert headers[DEAD_REASON] == "payload is not a greeting"
    assert headers[DEAD_SUBJECT] == lane.subject("poison")
    assert headers[DEAD_STREAM] == lane.stream
    assert headers[DEAD_DELIVERIES] == "1"


@pytest.mark.parametrize(
    ("error", "dead"),
    [
        (InvalidArgument("the prompt is malformed"), True),
        (NotFound("no such agent"), True),
        (Unavailable("the model gateway is down"), False),
        (Internal("unexpected"), False),
    ],
)
async def test_permanent_failures_are_dead_lettered_at_once(
    bus: Bus, lane: Lane, error: ParleyError, dead: bool
) -> None:
    calls: list[int] = []

    async def handle(delivery: Delivery) -> None:
        calls.append(delivery.num_delivered)
        if delivery.num_delivered == 1:
            raise error

    spec = lane.spec()
    consumer = PullConsumer(bus, spec, handle, fetch_timeout=0.5, backoff_base=0.05)
    async with running(consumer):
        await bus.publish(lane.subject(), b"payload")
        await eventually(lambda: lane.settled(spec.durable), what="the message settled")
    if dead:
        assert calls == [1]
        assert await lane.dead_count() == 1
        last = await bus.js.get_last_msg(bus.subjects.stream("DEAD"), lane.dead_subject)
        assert dict(last.headers or {})[DEAD_REASON].startswith("permanent failure:")
    else:
        assert calls == [1, 2]
        assert await lane.dead_count() == 0


async def test_transient_failures_are_retried_with_growing_delay(bus: Bus, lane: Lane) -> None:
    attempts: list[tuple[int, float]] = []
    base = 0.15

    async def handle(delivery: Delivery) -> None:
        attempts.append((delivery.num_delivered, time.monotonic()))
        if delivery.num_delivered < 3:
            raise ConnectionError("downstream hiccup")

    spec = lane.spec(max_deliver=5)
    consumer = PullConsumer(bus, spec, handle, backoff_base=base, backoff_cap=5, fetch_timeout=0.5)
    async with running(consumer):
        await bus.publish(lane.subject(), b"retry me")

        async def handled() -> bool:
            return len(attempts) >= 3 and await lane.settled(spec.durable)

        await eventually(handled, what="third delivery handled")

    assert [n for n, _ in attempts] == [1, 2, 3]
    first_gap = attempts[1][1] - attempts[0][1]
    second_gap = attempts[2][1] - attempts[1][1]
    # The nak delays are base * 2**(n-1): 0.15 s then 0.30 s; redelivery may not come earlier.
    assert first_gap >= base * 0.9
    assert second_gap >= 2 * base * 0.9
    assert second_gap > first_gap
    assert await lane.dead_count() == 0


async def test_always_failing_is_dead_lettered_after_max_deliver(bus: Bus, lane: Lane) -> None:
    deliveries: list[int] = []

    async def handle(delivery: Delivery) -> None:
        deliveries.append(delivery.num_delivered)
        raise RuntimeError("always broken")

    spec = lane.spec(max_deliver=3)
    registry = CollectorRegistry()
    consumer = PullConsumer(
        bus,
        spec,
        handle,
        backoff_base=0.05,
        backoff_cap=1,
        fetch_timeout=0.5,
        metrics=MessagingMetrics(registry),
    )
    async with running(consumer):
        await bus.publish(lane.subject("doomed"), b"doomed", msg_id="doomed-1")

        async def dead() -> bool:
            return await lane.dead_count() == 1 and await lane.settled(spec.durable)

        await eventually(dead, what="dead-lettered after max_deliver")

    assert deliveries == [1, 2, 3]
    headers = await lane.dead_headers()
    assert headers[DEAD_REASON].startswith("max_deliver (3) reached")
    assert "RuntimeError: always broken" in headers[DEAD_REASON]
    assert headers[DEAD_DELIVERIES] == "3"
    assert headers[DEAD_SUBJECT] == lane.subject("doomed")

    def sample(name: str, **labels: str) -> float | None:
        return registry.get_sample_value(name, {"stream": lane.stream, **labels})

    assert sample("parley_received_messages_total") == 3
    assert sample("parley_processed_duration_seconds_count", outcome="nak") == 2
    assert sample("parley_processed_duration_seconds_count", outcome="dead") == 1
    assert sample("parley_dead_letters_total", reason="max_deliver") == 1
    assert sample("parley_messages_inflight") == 0


def garbage_payloads() -> list[bytes]:
    rng = random.Random(20240611)
    fixed = [
        b"",
        b"\x00",
        b"\xff\xfe\xfd",
        b"{",
        b"null",
        b"[1, 2",
        "ünïcødé".encode("utf-16"),
        b"\x80" * 4096,
    ]
    return fixed + [rng.randbytes(rng.randint(1, 2048)) for _ in range(24)]


async def test_garbage_never_crashes_the_consumer(bus: Bus, lane: Lane) -> None:
    handled: list[dict[str, str]] = []

    async def handle(delivery: Delivery) -> None:
        try:
            body = json.loads(delivery.data.decode())
        except (UnicodeDecodeError, ValueError) as exc:
            raise Poison(f"not JSON: {type(exc).__name__}") from exc
        if not isinstance(body, dict) or "text" not in body:
            # A validation bug the handler did not foresee: a plain crash, retried then dead-lettered.
            raise KeyError("text")
        handled.append(body)

    spec = lane.spec(max_deliver=2)
    garbage = garbage_payloads()
    consumer = PullConsumer(bus, spec, handle, backoff_base=0.05, backoff_cap=0.2, fetch_timeout=0.5)
    async with running(consumer):
        for i, payload in enumerate(garbage):
            await bus.publish(lane.subject(f"g{i % 3}"), payload)
        await bus.publish(lane.subject("good"), json.dumps({"text": "still alive"}).encode())

        async def all_done() -> bool:
            return (
                handled == [{"text": "still alive"}]
                and await lane.dead_count() == len(garbage)
                and await lane.settled(spec.durable)
            )

        await eventually(all_done, timeout=15, what="good message handled and every bad one dead")
        assert consumer._loop_task is not None
        assert not consumer._loop_task.done()


async def test_stop_cancels_a_stuck_handler_without_acking(bus: Bus, lane: Lane) -> None:
    entered = asyncio.Event()
    cancelled: list[int] = []

    async def stuck(delivery: Delivery) -> None:
        entered.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.append(delivery.num_delivered)
            raise

    spec = lane.spec(ack_wait_seconds=1.5)
    first = PullConsumer(bus, spec, stuck, fetch_timeout=0.5)
    await first.start()
    try:
        await bus.publish(lane.subject(), b"long job", msg_id="long-1")
        async with asyncio.timeout(10):
            await entered.wait()
    finally:
        started = time.monotonic()
        await first.stop(timeout=0.3)
    assert time.monotonic() - started < 5
    assert cancelled == [1]
    info = await bus.js.consumer_info(lane.stream, spec.durable)
    assert info.ack_floor.stream_seq == 0, "a cancelled handler must not ack"

    seen, handle = recorder()
    async with running(PullConsumer(bus, spec, handle, fetch_timeout=0.5)):

        async def redelivered() -> bool:
            return len(seen) == 1 and await lane.settled(spec.durable)

        await eventually(redelivered, timeout=10, what="redelivery to the second consumer")
    assert seen[0].data == b"long job"
    assert seen[0].num_delivered >= 2


async def test_a_handler_longer_than_ack_wait_is_kept_alive_by_heartbeats(bus: Bus, lane: Lane) -> None:
    """A turn that takes three times the ack wait is neither redelivered to another consumer of the
    same durable nor handled twice: the consumer tells the server that work goes on."""
    spec = lane.spec(ack_wait_seconds=1)
    handled: list[tuple[str, int]] = []

    def slow(name: str) -> Callable[[Delivery], Awaitable[None]]:
        async def handle(delivery: Delivery) -> None:
            handled.append((name, delivery.num_delivered))
            await asyncio.sleep(3.2)

        return handle

    async with (
        running(PullConsumer(bus, spec, slow("a"), fetch_timeout=0.5)),
        running(PullConsumer(bus, spec, slow("b"), fetch_timeout=0.5)),
    ):
        await bus.publish(lane.subject(), b"long turn", msg_id="long-turn-1")
        await eventually(lambda: lane.settled(spec.durable), timeout=15, what="the long turn acked")
        await asyncio.sleep(1.5)  # longer than ack_wait: a lost heartbeat would show as a redelivery
    assert len(handled) == 1, handled
    assert handled[0][1] == 1


async def test_concurrency_is_bounded_and_each_message_handled_once(bus: Bus, lane: Lane) -> None:
    total, limit = 200, 16
    handled: Counter[bytes] = Counter()
    inflight = 0
    peak = 0

    async def handle(delivery: Delivery) -> None:
        nonlocal inflight, peak
        inflight += 1
        peak = max(peak, inflight)
        try:
            await asyncio.sleep(0.01)  # simulated work, so that handlers overlap
            handled[delivery.data] += 1
        finally:
            inflight -= 1

    for i in range(total):
        await bus.publish(lane.subject(f"c{i % 7}"), f"job-{i}".encode(), msg_id=f"job-{i}")
    spec = lane.spec()
    consumer = PullConsumer(bus, spec, handle, concurrency=limit, batch=64, fetch_timeout=0.5)
    async with running(consumer):

        async def all_handled() -> bool:
            return sum(handled.values()) >= total and await lane.settled(spec.durable)

        await eventually(all_handled, timeout=15, what=f"{total} messages handled")

    assert set(handled) == {f"job-{i}".encode() for i in range(total)}
    assert set(handled.values()) == {1}
    assert 1 < peak <= limit
    info = await bus.js.consumer_info(lane.stream, spec.durable)
    assert info.num_redelivered == 0


async def test_message_is_not_lost_when_dead_lettering_fails_on_the_last_delivery(
    bus: Bus, lane: Lane, test_env: SessionEnv
) -> None:
    # A bus in a namespace of its own has no DEAD stream yet, so dead-lettering fails.
    namespace = f"x{uuid.uuid4().hex[:8]}"
    other = await Bus.connect(test_env.nats_url, name="no-dead", namespace=namespace)
    dead = next(s for s in standard_streams(other.subjects) if s.name == other.subjects.stream("DEAD"))
    calls: list[int] = []

    async def poison(delivery: Delivery) -> None:
        calls.append(delivery.num_delivered)
        raise Poison("never valid")

    try:
        spec = lane.spec(max_deliver=2)
        consumer = PullConsumer(other, spec, poison, backoff_base=0.05, backoff_cap=0.2, fetch_timeout=0.5)
        async with running(consumer):
            await bus.publish(lane.subject(), b"bad")

            async def delivered() -> bool:
                return calls == [1]

            await eventually(delivered, timeout=5, what="the poison message delivered")
            # The dead-letter publish keeps failing: the message is held (heartbeats keep it from
            # being redelivered), neither acked nor terminated. Nothing to poll for: this checks
            # that nothing happens for a while.
            await asyncio.sleep(0.3)
            assert not await lane.settled(spec.durable), "the message must be held, not given up"
            # The dead-letter stream comes back: the message must still reach it.
            await other.ensure_stream(dead)

            async def dead_lettered() -> bool:
                info = await other.js.stream_info(dead.name)
                return info.state.messages == 1

            await eventually(dead_lettered, timeout=5, what="message dead-lettered after all")
            await eventually(lambda: lane.settled(spec.durable), timeout=5, what="the message terminated")
            assert calls == [1]
    finally:
        with contextlib.suppress(Exception):
            await other.js.delete_stream(dead.name)
        await other.close()


async def test_a_last_delivery_whose_process_died_is_dead_lettered_by_another_replica(
    bus: Bus, lane: Lane, test_env: SessionEnv
) -> None:
    """The replica holding the last allowed delivery loses its connection mid-handler (as a killed
    process does): JetStream's max-deliveries advisory reaches the surviving replica, which
    dead-letters the message once and reports it to the service."""
    entered = asyncio.Event()

    async def stuck(delivery: Delivery) -> None:
        entered.set()
        await asyncio.Event().wait()

    handled, handle = recorder()
    exhausted: list[tuple[str, bytes, int]] = []

    async def on_exhausted(subject: str, data: bytes, sequence: int) -> None:
        exhausted.append((subject, data, sequence))

    spec = lane.spec(ack_wait_seconds=1, max_deliver=1)
    dying_bus = await Bus.connect(test_env.nats_url, name="dying", namespace=bus.subjects.ns)
    dying = PullConsumer(dying_bus, spec, stuck, fetch_timeout=0.5)
    survivor = PullConsumer(bus, spec, handle, fetch_timeout=0.5, on_exhausted=on_exhausted)
    await dying.start()
    try:
        await bus.publish(lane.subject("job"), b"last chance", msg_id="job-1")
        async with asyncio.timeout(10):
            await entered.wait()
        async with running(survivor):  # started once the other holds the message's only delivery
            await dying_bus.nc.close()  # no more heartbeats, no ack: the delivery is lost

            async def reported() -> bool:
                return len(exhausted) == 1 and await lane.dead_count() == 1

            await eventually(reported, timeout=15, what="the exhausted message to be dead-lettered")
            headers = await lane.dead_headers()
            assert "no delivery was acknowledged" in headers[DEAD_REASON]
            assert headers[DEAD_SUBJECT] == lane.subject("job")
            assert headers[DEAD_STREAM] == lane.stream
            assert exhausted == [(lane.subject("job"), b"last chance", 1)]
            assert handled == [], "max_deliver 1: nobody may handle it again"
    finally:
        await dying.stop(timeout=0.2)
    assert await lane.dead_count() == 1


async def test_a_recreated_stream_is_consumed_again_with_a_newer_epoch(bus: Bus, lane: Lane) -> None:
    """Deleting and creating the stream again leaves a fetch that only times out; the idle
    consumer notices, binds again, and the new stream's messages sort after the old ones."""
    seen, handle = recorder()
    spec = lane.spec()
    async with running(PullConsumer(bus, spec, handle, fetch_timeout=0.2, check_interval=0.3)):
        await bus.publish(lane.subject(), b"before", msg_id="before")
        await bus.publish(lane.subject(), b"before 2", msg_id="before-2")
        await eventually(lambda: _count(seen, 2), what="the first stream's messages")
        await bus.js.delete_stream(lane.stream)
        await bus.ensure_stream(
            StreamSpec(name=lane.stream, subjects=[f"{lane.subject_prefix}.>"], max_age_seconds=600)
        )
        await bus.publish(lane.subject(), b"after", msg_id="after")
        await eventually(lambda: _count(seen, 3), timeout=15, what="the recreated stream's message")
    before, after = seen[1], seen[2]
    assert after.data == b"after"
    assert after.stream_sequence == 1 < before.stream_sequence
    assert after.stream_epoch > before.stream_epoch
    assert after.position > before.position


async def _count(seen: list[Delivery], n: int) -> bool:
    return len(seen) >= n


async def test_consumers_told_to_stop_taking_work_together_stop_in_one_fetch_not_one_each(
    bus: Bus, lane: Lane
) -> None:
    """What the service host does at shutdown: every consumer stops fetching at once, so idle
    consumers stopped one after another wait out their long polls together, not in turn; and a
    message published after that is left in the stream for the next replica."""
    seen, handle = recorder()
    fetch_timeout = 1.0
    consumers = [PullConsumer(bus, lane.spec(), handle, fetch_timeout=fetch_timeout) for _ in range(4)]
    for consumer in consumers:
        await consumer.start()
    await asyncio.sleep(0.2)  # every loop is inside an idle fetch
    started = time.monotonic()
    for consumer in consumers:
        consumer.stop_taking_work()
    await asyncio.sleep(fetch_timeout + 0.2)  # the fetches under way have run out
    await bus.publish(lane.subject(), b"after the stop", msg_id=f"late-{uuid.uuid4().hex}")
    stopping = time.monotonic()
    for consumer in reversed(consumers):
        await consumer.stop(timeout=2)
    took = time.monotonic() - stopping
    assert took < 0.5 * fetch_timeout, f"each stop waited for a fetch of its own: {took:.2f} s"
    assert seen == [], "a consumer told to stop took new work"
    for consumer in consumers:
        info = await bus.js.consumer_info(lane.stream, consumer.spec.durable)
        assert (info.num_pending, info.num_ack_pending) == (1, 0)
    print(f"4 idle consumers: stopped {time.monotonic() - started:.2f} s after the signal")
