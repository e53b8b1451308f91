"""Turn latency and throughput through the real pipeline, against its own floor.

A client publishes inbound messages to JetStream and waits for each reply on the
outbound subject; the runtime and model gateway run as real processes, the
scripted model answers at zero latency. In the same run it measures the floor:
the raw round trips one turn cannot avoid — a JetStream publish→consume (the
inbound message), a NATS request/reply (the model call), two SQL statements
(ingest with the room history, save the reply and finish the turn) and a JetStream publish (the
reply) — and reports the ratio of a turn to the sum of those.

The default messages are two words. REFLECTION reflects on a room's every fourth turn, whatever
its words (the default character's cadence, elizaOS's), so one turn in four of each room has its
evaluator section, batched model call and stored facts after the reply. ``--reflection-interval 1``
makes it reflect after every message of four words or more instead: with ``--words 8``, after
every message.

Usage: python bench/turn_latency.py [--sequential 300] [--concurrent 2000] [--in-flight 64] [--words 2]
    [--reflection-interval N]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import secrets
import time
import uuid

import psycopg
import yaml
from _common import (
    ROOT,
    BenchEnv,
    Series,
    bench_env,
    cpu_ms_per_op,
    cpu_snapshot,
    pids_matching,
    report,
    suite_env,
)
from nats.js.api import AckPolicy, ConsumerConfig

from parley.v1 import runtime_pb2
from parley_devinfra.infra import free_port
from parley_platform.bus import Bus
from parley_platform.testing import ServiceProcess

AGENT_ID = str(uuid.uuid5(uuid.UUID("6f1f3f3e-6a0c-5b8e-9a57-5061726c6579"), "agent:default"))
SQL_PER_TURN = 2


async def timed(n: int, in_flight: int, op: object) -> Series:
    """Run ``op(i)`` n times with at most ``in_flight`` at once; latencies per call."""
    latencies: list[float] = []
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(n):
        queue.put_nowait(i)

    async def worker(slot: int) -> None:
        while not queue.empty():
            i = queue.get_nowait()
            started = time.perf_counter()
            await op(i, slot)  # type: ignore[operator]
            latencies.append(time.perf_counter() - started)

    started = time.perf_counter()
    await asyncio.gather(*(worker(s) for s in range(in_flight)))
    return Series("", latencies, time.perf_counter() - started)


async def floors(env: BenchEnv, bus: Bus, n: int, in_flight: int) -> dict[str, Series]:
    results: dict[str, Series] = {}
    stream = f"{env.namespace.upper()}_FLOOR"
    subject = f"{env.namespace}.floor.js"
    await bus.js.add_stream(name=stream, subjects=[subject])
    await bus.js.add_consumer(stream, ConsumerConfig(durable_name="floor", ack_policy=AckPolicy.EXPLICIT))
    sub = await bus.js.pull_subscribe_bind("floor", stream)
    lock = asyncio.Lock()

    async def js_roundtrip(i: int, slot: int) -> None:
        await bus.js.publish(subject, b"x" * 120)
        async with lock:
            [msg] = await sub.fetch(1, timeout=5)
        await msg.ack()

    async def js_publish(i: int, slot: int) -> None:
        await bus.js.publish(subject, b"x" * 120)

    async def echo(msg: object) -> None:
        await msg.respond(msg.data)  # type: ignore[attr-defined]

    await bus.nc.subscribe(f"{env.namespace}.floor.rr", cb=echo)

    async def request_reply(i: int, slot: int) -> None:
        await bus.nc.request(f"{env.namespace}.floor.rr", b"x" * 200, timeout=5)

    conns = [await psycopg.AsyncConnection.connect(env.database_url, autocommit=True) for _ in range(16)]
    await conns[0].execute("CREATE TABLE IF NOT EXISTS bench_floor (id int PRIMARY KEY, n bigint NOT NULL)")
    await conns[0].execute(
        "INSERT INTO bench_floor SELECT g, 0 FROM generate_series(0, 63) g ON CONFLICT DO NOTHING"
    )

    async def sql(i: int, slot: int) -> None:
        conn = conns[slot % len(conns)]
        await conn.execute(
            "UPDATE bench_floor SET n = n + 1 WHERE id = %s RETURNING n", (slot,), prepare=True
        )

    for name, op in [
        ("js publish→consume", js_roundtrip),
        ("js publish", js_publish),
        ("nats request/reply", request_reply),
        ("sql statement", sql),
    ]:
        await timed(min(n, 100), 1, op)  # warm-up
        seq = await timed(n, 1, op)
        seq.name = f"floor: {name}, sequential"
        results[f"{name}:1"] = seq
        conc = await timed(n * 4, in_flight if name != "js publish→consume" else 1, op)
        conc.name = f"floor: {name}, {in_flight if name != 'js publish→consume' else 1} in flight"
        results[f"{name}:n"] = conc
    for conn in conns:
        await conn.close()
    await bus.js.delete_stream(stream)
    return results


def characters(env: BenchEnv, reflection_interval: int | None) -> dict[str, str]:
    """The default character, with ``REFLECTION_INTERVAL`` set when asked for (else its own cadence)."""
    if reflection_interval is None:
        return {}
    folder = env.logs.parent / "characters"
    folder.mkdir(exist_ok=True)
    character = yaml.safe_load((ROOT / "characters" / "default.yaml").read_text())
    character["settings"] = {**(character.get("settings") or {}), "REFLECTION_INTERVAL": reflection_interval}
    (folder / "default.yaml").write_text(yaml.safe_dump(character))
    return {"PARLEY_CHARACTERS_DIR": str(folder)}


class Client:
    """A connector that publishes inbound messages and matches replies by message id."""

    def __init__(self, bus: Bus, words: int = 2) -> None:
        self.bus = bus
        self.waiting: dict[str, asyncio.Future[None]] = {}
        # "message <i>", then filler words up to ``words`` (with REFLECTION_INTERVAL 1, REFLECTION
        # reflects on messages of four words or more).
        self.filler = "".join(f" word{k}" for k in range(max(0, words - 2)))

    async def start(self) -> None:
        async def on_reply(msg: object) -> None:
            reply = runtime_pb2.OutboundMessage.FromString(msg.data)  # type: ignore[attr-defined]
            future = self.waiting.pop(reply.in_reply_to, None)
            if future and not future.done():
                future.set_result(None)

        await self.bus.nc.subscribe(self.bus.subjects.outbound(AGENT_ID, "bench"), cb=on_reply)

    async def turn(self, i: int, slot: int) -> None:
        message_id = secrets.token_hex(8)
        future = asyncio.get_running_loop().create_future()
        self.waiting[message_id] = future
        inbound = runtime_pb2.InboundMessage(
            agent_id=AGENT_ID,
            source="bench",
            message_id=message_id,
            sender_id=f"user-{slot}",
            sender_name=f"User {slot}",
            channel_id=f"room-{slot}",
            room_type=runtime_pb2.ROOM_TYPE_DM,
            text=f"message {i}{self.filler}",
        )
        await self.bus.publish(
            self.bus.subjects.inbound(AGENT_ID, "bench"),
            inbound.SerializeToString(),
            msg_id=f"bench:{message_id}",
        )
        await asyncio.wait_for(future, 30)


async def main(args: argparse.Namespace) -> None:
    with bench_env(nats_auth=args.nats_auth == "on") as env:
        common = suite_env(env)  # each service connects as its own identity
        gw_port, rt_port = free_port(), free_port()
        gateway = ServiceProcess(
            "parley_gateway",
            {
                **common,
                "PARLEY_GATEWAY_GRPC_PORT": str(gw_port),
                "PARLEY_GATEWAY_METRICS_PORT": str(free_port()),
                # No scheduler runs here: the gateway drains the prompt batcher (REFLECTION's
                # sections) on its own timer, as it does without one.
                "PARLEY_BATCHER_SELF_DRAIN": "true",
            },
            env.logs / "gateway.log",
            gw_port,
        ).start()
        runtime = ServiceProcess(
            "parley_runtime",
            {
                **common,
                "PARLEY_RUNTIME_GRPC_PORT": str(rt_port),
                "PARLEY_RUNTIME_METRICS_PORT": str(free_port()),
                **characters(env, args.reflection_interval),
            },
            env.logs / "runtime.log",
            rt_port,
        ).start()
        bus = await Bus.connect(env.nats_url, name="bench", namespace=env.namespace)
        try:
            await gateway.wait_ready()
            await runtime.wait_ready()
            client = Client(bus, args.words)
            await client.start()
            await timed(50, 1, client.turn)  # warm-up: connections, prepared statements
            groups = {
                "runtime": lambda: [runtime.pid],
                "gateway": lambda: [gateway.pid],
                "postgres": lambda: pids_matching(
                    "postgres: ", env.database_url.rsplit("/", 1)[-1].split("?")[0]
                ),
                "nats": lambda: pids_matching("nats-server", str(env.logs.parent)),
                "client": lambda: [os.getpid()],
            }
            before = cpu_snapshot(groups)
            sequential = await timed(args.sequential, 1, client.turn)
            sequential.name = "turn, sequential"
            seq_cpu = cpu_ms_per_op(before, cpu_snapshot(groups), args.sequential)
            before = cpu_snapshot(groups)
            concurrent = await timed(args.concurrent, args.in_flight, client.turn)
            concurrent.name = f"turn, {args.in_flight} in flight"
            conc_cpu = cpu_ms_per_op(before, cpu_snapshot(groups), args.concurrent)
            floor = await floors(env, bus, args.sequential, args.in_flight)
        finally:
            await bus.close()
            runtime.stop()
            gateway.stop()

    def p50(key: str) -> float:
        return floor[key].p50_ms

    floor_seq_ms = (
        p50("js publish→consume:1")
        + p50("nats request/reply:1")
        + SQL_PER_TURN * p50("sql statement:1")
        + p50("js publish:1")
    )
    # Throughput floor: each leg at its own concurrent rate, one after another for every turn.
    per_turn_seconds = (
        1 / floor["js publish:n"].rate
        + 1 / floor["nats request/reply:n"].rate
        + SQL_PER_TURN / floor["sql statement:n"].rate
        + 1 / floor["js publish:n"].rate
    )
    floor_rate = 1 / per_turn_seconds
    summary = {
        "benchmark": "turn_latency",
        # CPU ms per turn of each process (the background work after a reply included, except
        # what is still running when the timing ends).
        "turn_sequential": {
            **sequential.figures(),
            **seq_cpu,
            "suite_cpu_ms": round(sum(seq_cpu.values()), 3),
        },
        "turn_concurrent": {
            **concurrent.figures(),
            **conc_cpu,
            "suite_cpu_ms": round(sum(conc_cpu.values()), 3),
            "in_flight": args.in_flight,
        },
        "floor": {key: series.figures() for key, series in floor.items()},
        "floor_turn_sequential_p50_ms": round(floor_seq_ms, 3),
        "floor_turn_throughput_per_s": round(floor_rate, 1),
        "ratio_to_floor": round(sequential.p50_ms / floor_seq_ms, 2),
        "throughput_ratio_to_floor": round(concurrent.rate / floor_rate, 2),
        "nats_auth": args.nats_auth,
        "words": args.words,
        "reflection_interval": args.reflection_interval or 4,
    }
    report(
        "Turn latency (scripted model, zero latency; 1 runtime, 1 gateway)",
        [sequential, concurrent, *floor.values()],
        summary,
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sequential", type=int, default=300)
    parser.add_argument("--concurrent", type=int, default=2000)
    parser.add_argument("--in-flight", type=int, default=64)
    parser.add_argument(
        "--words",
        type=int,
        default=2,
        help="words per message (REFLECTION_INTERVAL 1: REFLECTION reflects on those of 4 or more)",
    )
    parser.add_argument(
        "--reflection-interval",
        type=int,
        default=None,
        help="the agent's REFLECTION_INTERVAL: REFLECTION on a room's every Nth turn (default: the"
        " character's, 4); 1: after every message of 4 words or more (its batched model call, the"
        " facts it stores)",
    )
    parser.add_argument(
        "--nats-auth",
        choices=["on", "off"],
        default="on",
        help="off: NATS open to anyone, no identities or permissions (what they cost, issue 12)",
    )
    asyncio.run(main(parser.parse_args()))
