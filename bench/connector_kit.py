"""The connector kit's round trip against raw NATS doing the same work, in the same run.

A stand-in agent (a JetStream pull consumer on the inbound subject that publishes an
OutboundMessage for each message and acks it) answers both paths identically, so what differs is
only the connector's side:
- kit: ``Connector.send(Inbound)`` (validation, protobuf encoding, the JetStream publish and its
  ack) and the reply from ``Connector.replies()`` (durable pull consumer, decoding, ``ack()``);
- floor: raw nats-py doing the least the same wire needs: ``js.publish`` of pre-encoded bytes with
  a Nats-Msg-Id, ``fetch`` from a durable consumer on the outbound subject, ``ack``.
Sequential round trips (latency) and concurrent ones (``--in-flight`` at once, throughput); the
ratios kit/floor are what the kit costs.

Usage: python bench/connector_kit.py [--sequential 500] [--concurrent 2000] [--in-flight 32]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import time
import uuid
from collections.abc import Awaitable, Callable

from _common import Series, bench_env, report
from nats.aio.msg import Msg
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from parley.v1 import runtime_pb2
from parley_connectors import Connector, Inbound
from parley_platform.bus import Bus

AGENT = str(uuid.uuid4())


async def stand_in_agent(bus: Bus, stop: asyncio.Event) -> None:
    """Answers every inbound message of the namespace with an OutboundMessage, like the runtime."""
    stream = bus.subjects.stream("INBOUND")
    await bus.js.add_consumer(
        stream, ConsumerConfig(durable_name="agent", ack_policy=AckPolicy.EXPLICIT, max_ack_pending=10_000)
    )
    sub = await bus.js.pull_subscribe_bind("agent", stream)

    async def answer(msg: Msg) -> None:
        inbound = runtime_pb2.InboundMessage.FromString(msg.data)
        reply = runtime_pb2.OutboundMessage(
            agent_id=inbound.agent_id,
            source=inbound.source,
            response_id=f"r-{inbound.message_id}",
            channel_id=inbound.channel_id,
            in_reply_to=inbound.message_id,
            text=f"You said: {inbound.text}",
        )
        await bus.publish(
            bus.subjects.outbound(inbound.agent_id, inbound.source),
            reply.SerializeToString(),
            msg_id=reply.response_id,
        )
        await msg.ack()

    while not stop.is_set():
        try:
            msgs = await sub.fetch(64, timeout=0.5)
        except TimeoutError:
            continue
        await asyncio.gather(*(answer(m) for m in msgs))


async def run(
    label: str,
    n: int,
    in_flight: int,
    send: Callable[[str], Awaitable[None]],
    replies: Callable[[dict[str, asyncio.Future[None]]], Awaitable[None]],
) -> Series:
    waiting: dict[str, asyncio.Future[None]] = {}
    receiver = asyncio.create_task(replies(waiting))
    latencies: list[float] = []
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(n):
        queue.put_nowait(i)

    async def worker() -> None:
        while not queue.empty():
            queue.get_nowait()
            message_id = uuid.uuid4().hex
            done = waiting[message_id] = asyncio.get_running_loop().create_future()
            started = time.perf_counter()
            await send(message_id)
            await asyncio.wait_for(done, 30)
            latencies.append(time.perf_counter() - started)

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(in_flight)))
    wall = time.perf_counter() - started
    receiver.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await receiver
    return Series(label, latencies, wall)


def settle(waiting: dict[str, asyncio.Future[None]], message_id: str) -> None:
    future = waiting.pop(message_id, None)
    if future is not None and not future.done():
        future.set_result(None)


async def kit_path(bus: Bus, n: int, in_flight: int, label: str) -> Series:
    conn = await Connector(
        bus, source="kit", agent_ids=[AGENT], durable=f"kit-{uuid.uuid4().hex[:8]}"
    ).start()

    async def send(message_id: str) -> None:
        await conn.send(Inbound(message_id=message_id, sender_id="ann", channel_id="c1", text="hello"))

    async def replies(waiting: dict[str, asyncio.Future[None]]) -> None:
        async for reply in conn.replies():
            await reply.ack()
            settle(waiting, reply.in_reply_to)

    return await run(label, n, in_flight, send, replies)


async def raw_path(bus: Bus, n: int, in_flight: int, label: str) -> Series:
    inbound = bus.subjects.inbound(AGENT, "raw")
    # A consumer per run: a cancelled fetch of an earlier run may hold an outstanding pull request.
    stream, durable = bus.subjects.stream("OUTBOUND"), f"raw-{uuid.uuid4().hex[:8]}"
    await bus.js.add_consumer(
        stream,
        ConsumerConfig(
            name=durable,
            durable_name=durable,
            filter_subject=bus.subjects.outbound(AGENT, "raw"),
            ack_policy=AckPolicy.EXPLICIT,
            deliver_policy=DeliverPolicy.NEW,
        ),
    )
    sub = await bus.js.pull_subscribe_bind(durable, stream)

    async def send(message_id: str) -> None:
        payload = runtime_pb2.InboundMessage(
            agent_id=AGENT,
            source="raw",
            message_id=message_id,
            sender_id="ann",
            channel_id="c1",
            text="hello",
        ).SerializeToString()
        await bus.js.publish(inbound, payload, headers={"Nats-Msg-Id": f"raw:{message_id}"})

    async def replies(waiting: dict[str, asyncio.Future[None]]) -> None:
        while True:
            try:
                [msg] = await sub.fetch(1, timeout=1)
            except TimeoutError:
                continue
            await msg.ack()
            # the id without decoding the reply: the stand-in names it r-<message id>
            settle(waiting, (msg.headers or {})["Nats-Msg-Id"].removeprefix("r-"))

    return await run(label, n, in_flight, send, replies)


async def main(sequential: int, concurrent: int, in_flight: int) -> None:
    with bench_env() as env:
        bus = await Bus.connect(env.nats_url, name="bench-connector-kit", namespace=env.namespace)
        await bus.ensure_standard_streams()
        stop = asyncio.Event()
        agent = asyncio.create_task(stand_in_agent(bus, stop))
        try:
            await raw_path(bus, min(50, sequential), 1, "warm-up")
            rows = [
                await raw_path(bus, sequential, 1, "floor: raw publish/fetch/ack, sequential"),
                await kit_path(bus, sequential, 1, "kit: send -> replies -> ack, sequential"),
                await raw_path(bus, concurrent, in_flight, f"floor: raw, {in_flight} in flight"),
                await kit_path(bus, concurrent, in_flight, f"kit: {in_flight} in flight"),
            ]
        finally:
            stop.set()
            await agent
            await bus.close()
    floor_seq, kit_seq, floor_conc, kit_conc = rows
    summary: dict[str, object] = {
        "benchmark": "connector_kit",
        "kit_sequential": kit_seq.figures(),
        "floor_sequential": floor_seq.figures(),
        "kit_concurrent": kit_conc.figures(),
        "floor_concurrent": floor_conc.figures(),
        "ratio_p50_to_floor": round(kit_seq.p50_ms / floor_seq.p50_ms, 3),
        "throughput_ratio_to_floor": round(kit_conc.rate / floor_conc.rate, 3),
        "kit_round_trip_p50_ms": round(kit_seq.p50_ms, 3),
    }
    report("connector kit: send -> reply round trip vs raw NATS", rows, summary)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sequential", type=int, default=500)
    parser.add_argument("--concurrent", type=int, default=2000)
    parser.add_argument("--in-flight", type=int, default=32)
    args = parser.parse_args()
    asyncio.run(main(args.sequential, args.concurrent, args.in_flight))
