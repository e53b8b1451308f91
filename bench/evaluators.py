"""Model calls per message turn with REFLECTION on: each evaluator on its own (before) against the
evaluators through the prompt batcher (after), and the floor (the turn's own planner call).

The model gateway and a runtime run as processes with the scripted model at zero latency. A client
sends ``--turns`` sequential messages into one room, each long enough for REFLECTION to run (its
agents reflect after every message, ``REFLECTION_INTERVAL: 1``, not every fourth turn), and
the gateway's usage ledger (model.usage: every provider call, by kind: generate, stream, batch)
counts the calls once the background work has stopped. Three runtimes are measured, each with an
agent of its own so that the counts do not mix:

- ``unbatched``: PARLEY_EVALUATOR_BATCHING=false: REFLECTION asks the model on its own;
- ``batched, window 0``: each turn's evaluator sections are drained at once (one call per turn);
- ``batched, window W``: a turn's sections wait up to W ms for a drain of the room's affinity, so
  consecutive turns of a room share calls (up to PROMPT_BATCHER_MAX_SECTIONS_PER_CALL sections);

and the floor: the same turns with REFLECTION off (one call: the reply's).

The batcher packs up to PROMPT_BATCHER_MAX_SECTIONS_PER_CALL schema *fields* per call (default 8):
REFLECTION's three fields make two sections a call by default; ``--max-fields 24`` shows eight.

Usage: python bench/evaluators.py [--turns 60] [--window-ms 1000] [--max-fields N]
"""

from __future__ import annotations

import argparse
import asyncio
import secrets
import time
from pathlib import Path

import psycopg
from _common import BenchEnv, Series, bench_env, report, service_process, suite_env

from parley.v1 import runtime_pb2
from parley_platform.bus import Bus
from parley_platform.testing import ServiceProcess

NAMESPACE_AGENT = "agent:"


def agent_id(name: str) -> str:
    # parley_runtime.ids.agent_id, repeated: benchmarks reach services over the wire only.
    import uuid

    return str(uuid.uuid5(uuid.UUID("6f1f3f3e-6a0c-5b8e-9a57-5061726c6579"), f"{NAMESPACE_AGENT}{name}"))


def character(name: str, reflection: bool) -> str:
    # REFLECTION_INTERVAL 1: REFLECTION after every message (of four words or more), not on the
    # room's every fourth turn (its default), so that each turn has an evaluator section.
    settings = f"{{REFLECTION: {str(reflection).lower()}, REFLECTION_INTERVAL: 1}}"
    return f"name: {name}\nsystem: A benchmark agent.\nsettings: {settings}\n"


async def model_calls(env: BenchEnv, agent: str) -> int:
    async with await psycopg.AsyncConnection.connect(env.database_url, autocommit=True) as conn:
        cur = await conn.execute(
            "SELECT coalesce(sum(requests), 0) FROM model.usage"
            " WHERE agent_id = %s AND kind IN ('generate', 'stream', 'batch')",
            (agent,),
        )
        row = await cur.fetchone()
    return int(row[0]) if row else 0


async def settled_calls(env: BenchEnv, agent: str, quiet: float) -> int:
    """The agent's model calls once they stop changing (the evaluators run after each reply)."""
    last = await model_calls(env, agent)
    while True:
        await asyncio.sleep(quiet)
        now = await model_calls(env, agent)
        if now == last:
            return now
        last = now


class Client:
    def __init__(self, bus: Bus, agent: str) -> None:
        self.bus = bus
        self.agent = agent
        self.room = f"room-{secrets.token_hex(4)}"
        self.waiting: dict[str, asyncio.Future[None]] = {}

    async def start(self) -> None:
        async def on_reply(msg: object) -> None:
            reply = runtime_pb2.OutboundMessage.FromString(msg.data)  # type: ignore[attr-defined]
            future = self.waiting.pop(reply.in_reply_to, None)
            if future and not future.done():
                future.set_result(None)

        await self.bus.nc.subscribe(self.bus.subjects.outbound(self.agent, "bench"), cb=on_reply)

    async def turn(self, i: int) -> float:
        message_id = secrets.token_hex(8)
        future = asyncio.get_running_loop().create_future()
        self.waiting[message_id] = future
        message = runtime_pb2.InboundMessage(
            agent_id=self.agent,
            source="bench",
            message_id=message_id,
            sender_id="user",
            sender_name="User",
            channel_id=self.room,
            room_type=runtime_pb2.ROOM_TYPE_DM,
            text=f"please remember that item number {i} is painted blue",
        )
        started = time.perf_counter()
        await self.bus.publish(
            self.bus.subjects.inbound(self.agent, "bench"),
            message.SerializeToString(),
            msg_id=f"b:{message_id}",
        )
        await asyncio.wait_for(future, 60)
        return time.perf_counter() - started


async def measure(
    env: BenchEnv, bus: Bus, name: str, settings: dict[str, str], turns: int, characters: Path
) -> tuple[float, Series]:
    """Model calls per turn, and the turns' latencies, for one runtime configuration."""
    folder = characters / name
    folder.mkdir()
    (folder / f"{name}.yaml").write_text(character(name, settings.pop("REFLECTION") == "true"))
    runtime: ServiceProcess = service_process(
        "parley_runtime", env, {**suite_env(env), "PARLEY_CHARACTERS_DIR": str(folder), **settings}, name
    ).start()
    try:
        await runtime.wait_ready()
        agent = agent_id(name)
        client = Client(bus, agent)
        await client.start()
        await client.turn(-1)  # warm-up
        before = await settled_calls(env, agent, quiet=2.5)
        started = time.perf_counter()
        latencies = [await client.turn(i) for i in range(turns)]
        wall = time.perf_counter() - started
        after = await settled_calls(env, agent, quiet=2.5)
    finally:
        runtime.stop()
    return (after - before) / turns, Series(name, latencies, wall)


async def main(args: argparse.Namespace) -> None:
    with bench_env() as env:
        characters = env.logs.parent / "characters"
        characters.mkdir(parents=True)
        gateway_settings = suite_env(env)
        if args.max_fields:
            gateway_settings["PROMPT_BATCHER_MAX_SECTIONS_PER_CALL"] = str(args.max_fields)
        gateway = service_process("parley_gateway", env, gateway_settings, "gateway").start()
        bus = await Bus.connect(env.nats_url, name="bench", namespace=env.namespace)
        try:
            await gateway.wait_ready()
            runs = {
                "floor": {"REFLECTION": "false"},
                "unbatched": {"REFLECTION": "true", "PARLEY_EVALUATOR_BATCHING": "false"},
                "batched_window_0": {"REFLECTION": "true", "PARLEY_EVALUATOR_BATCH_WINDOW_MS": "0"},
                "batched_window": {
                    "REFLECTION": "true",
                    "PARLEY_EVALUATOR_BATCH_WINDOW_MS": str(args.window_ms),
                },
            }
            calls: dict[str, float] = {}
            rows: list[Series] = []
            for name, settings in runs.items():
                per_turn, series = await measure(env, bus, name, dict(settings), args.turns, characters)
                calls[name] = round(per_turn, 3)
                rows.append(series)
        finally:
            await bus.close()
            gateway.stop()
    floor = calls["floor"] or 1.0
    summary: dict[str, object] = {
        "benchmark": "evaluators",
        "turns": args.turns,
        "window_ms": args.window_ms,
        "max_fields_per_call": args.max_fields or "gateway default",
        "model_calls_per_turn": calls,
        "calls_per_turn_unbatched": calls["unbatched"],
        "calls_per_turn_batched": calls["batched_window"],
        "evaluator_calls_per_turn_unbatched": round(calls["unbatched"] - calls["floor"], 3),
        "evaluator_calls_per_turn_batched": round(calls["batched_window"] - calls["floor"], 3),
        "ratio_batched_to_floor": round(calls["batched_window"] / floor, 3),
        "ratio_unbatched_to_floor": round(calls["unbatched"] / floor, 3),
        "turn_p50_ms": {row.name: round(row.p50_ms, 1) for row in rows},
    }
    report("model calls per message turn, REFLECTION on (scripted model)", rows, summary)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--turns", type=int, default=60)
    parser.add_argument("--window-ms", type=int, default=1000)
    parser.add_argument(
        "--max-fields",
        type=int,
        default=0,
        help="the gateway's PROMPT_BATCHER_MAX_SECTIONS_PER_CALL (schema fields per call; REFLECTION has 3)",
    )
    asyncio.run(main(parser.parse_args()))
