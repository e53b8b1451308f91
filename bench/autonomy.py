"""What an autonomous turn costs against a message turn, in the same run.

The runtime and model gateway run as real processes (scripted model, zero latency). A message
turn: a connector's message published to JetStream until its reply arrives (the full message
pipeline: gate, should_respond, compose, the model call, plan, act, deliver). An autonomous turn:
the runtime's own message carrying a think answer, published on its own subject, until its reply
arrives (gate, think, act, deliver: the post-model stages, no model call). The ratio of their
p50s is the autonomous turn's cost relative to the message turn, its floor here. Then autonomy
is switched on (interval 5 s, the gateway draining the batcher on its own timer) and each tick is
timed from the think result's arrival on the bus to the autonomous turn's reply: the runtime's
share of a tick (both replicas' race and JetStream's deduplication included).

Usage: python bench/autonomy.py [--turns 200] [--ticks 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import secrets
import time
import uuid
from collections.abc import Awaitable, Callable

from _common import Series, bench_env, report, service_process, suite_env

from parley.v1 import runtime_pb2
from parley_platform.bus import Bus
from parley_platform.rpc import RpcClient

AGENT_ID = str(uuid.uuid5(uuid.UUID("6f1f3f3e-6a0c-5b8e-9a57-5061726c6579"), "agent:default"))


class Replies:
    """Replies on the outbound subjects of the `bench` connector and the autonomy room, each
    counted once: a core subscriber also sees the copies the runtime republishes to keep a room's
    replies in order (the OUTBOUND stream, which connectors read, drops them by id)."""

    def __init__(self, bus: Bus) -> None:
        self.bus = bus
        self.waiting: dict[str, asyncio.Future[float]] = {}
        self.any_autonomous: asyncio.Queue[float] = asyncio.Queue()
        self.seen: set[str] = set()

    async def start(self) -> None:
        async def on_reply(msg: object) -> None:
            arrived = time.perf_counter()
            reply = runtime_pb2.OutboundMessage.FromString(msg.data)  # type: ignore[attr-defined]
            if reply.response_id in self.seen:
                return
            self.seen.add(reply.response_id)
            future = self.waiting.pop(reply.in_reply_to, None)
            if future is not None and not future.done():
                future.set_result(arrived)
            elif reply.source == "autonomy":
                self.any_autonomous.put_nowait(arrived)

        for source in ("bench", "autonomy"):
            await self.bus.nc.subscribe(self.bus.subjects.outbound(AGENT_ID, source), cb=on_reply)

    def expect(self, message_id: str) -> asyncio.Future[float]:
        future: asyncio.Future[float] = asyncio.get_running_loop().create_future()
        self.waiting[message_id] = future
        return future


async def sequential(n: int, op: Callable[[int], Awaitable[None]], name: str) -> Series:
    latencies = []
    started = time.perf_counter()
    for i in range(n):
        began = time.perf_counter()
        await op(i)
        latencies.append(time.perf_counter() - began)
    return Series(name, latencies, time.perf_counter() - started)


async def main(args: argparse.Namespace) -> None:
    with bench_env() as env:
        common = {**suite_env(env), "PARLEY_BATCHER_SELF_DRAIN": "true", "AUTONOMY_INTERVAL_MS": "5000"}
        gateway = service_process("parley_gateway", env, common, "gateway").start()
        runtimes = [service_process("parley_runtime", env, common, f"runtime-{i}").start() for i in range(2)]
        bus = await Bus.connect(env.nats_url, name="bench", namespace=env.namespace)
        try:
            await gateway.wait_ready()
            for runtime in runtimes:
                await runtime.wait_ready()
            replies = Replies(bus)
            await replies.start()

            async def message_turn(i: int) -> None:
                message_id = secrets.token_hex(8)
                arrived = replies.expect(message_id)
                inbound = runtime_pb2.InboundMessage(
                    agent_id=AGENT_ID,
                    source="bench",
                    message_id=message_id,
                    sender_id="user-1",
                    sender_name="User",
                    channel_id="room-1",
                    room_type=runtime_pb2.ROOM_TYPE_DM,
                    text=f"message {i}",
                )
                await bus.publish(
                    bus.subjects.inbound(AGENT_ID, "bench"), inbound.SerializeToString(), msg_id=message_id
                )
                await asyncio.wait_for(arrived, 30)

            async def autonomous_turn(i: int) -> None:
                message_id = f"bench-{secrets.token_hex(8)}"
                arrived = replies.expect(message_id)
                inbound = runtime_pb2.InboundMessage(
                    agent_id=AGENT_ID,
                    source="autonomy",
                    message_id=message_id,
                    sender_id=AGENT_ID,
                    sender_name="default",
                    channel_id="autonomy",
                    room_type=runtime_pb2.ROOM_TYPE_SELF,
                    text=f"thought {i}",
                )
                inbound.metadata["parley_origin"] = "autonomous"
                inbound.metadata["parley_autonomy"] = json.dumps(
                    {"thought": f"thought {i}", "actions": "REPLY", "text": f"note {i}", "params": ""}
                )
                await bus.publish(
                    bus.subjects.self_inbound(AGENT_ID), inbound.SerializeToString(), msg_id=message_id
                )
                await asyncio.wait_for(arrived, 30)

            for _ in range(min(args.turns, 20)):  # warm-up: connections, prepared statements
                await message_turn(0)
                await autonomous_turn(0)
            message = await sequential(args.turns, message_turn, "message turn, sequential")
            autonomous = await sequential(args.turns, autonomous_turn, "autonomous turn, sequential")

            # Ticks: the think result on the bus → the autonomous turn's reply.
            results: asyncio.Queue[float] = asyncio.Queue()

            async def on_result(msg: object) -> None:
                results.put_nowait(time.perf_counter())

            await bus.nc.subscribe(f"{env.namespace}.model.batcher.result.{AGENT_ID}.*", cb=on_result)
            while not replies.any_autonomous.empty():  # only replies of the ticks pair with results
                replies.any_autonomous.get_nowait()
            await RpcClient(bus).call(
                "runtime",
                "SetAutonomy",
                runtime_pb2.SetAutonomyRequest(agent_id=AGENT_ID, enabled=True),
                runtime_pb2.AutonomyStatus,
                timeout=20,
            )
            ticks = []
            tick_started = time.perf_counter()
            while len(ticks) < args.ticks:
                result_at = await asyncio.wait_for(results.get(), 30)
                reply_at = await asyncio.wait_for(replies.any_autonomous.get(), 30)
                ticks.append(reply_at - result_at)
            tick = Series("tick: think result → autonomous reply", ticks, time.perf_counter() - tick_started)
            await RpcClient(bus).call(
                "runtime",
                "SetAutonomy",
                runtime_pb2.SetAutonomyRequest(agent_id=AGENT_ID, enabled=False),
                runtime_pb2.AutonomyStatus,
                timeout=20,
            )
        finally:
            await bus.close()
            for runtime in runtimes:
                runtime.stop()
            gateway.stop()

    summary = {
        "benchmark": "autonomy",
        "message_turn": message.figures(),
        "autonomous_turn": autonomous.figures(),
        "tick": tick.figures(),
        "ratio_autonomous_to_message_turn": round(autonomous.p50_ms / message.p50_ms, 2),
        "ratio_tick_to_message_turn": round(tick.p50_ms / message.p50_ms, 2),
    }
    report(
        "Autonomous turns against message turns (scripted model, zero latency; 2 runtimes, 1 gateway)",
        [message, autonomous, tick],
        summary,
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=200)
    parser.add_argument("--ticks", type=int, default=3)
    asyncio.run(main(parser.parse_args()))
