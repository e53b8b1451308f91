"""Confirmed actions: from a person's approval to the action run and settled, against its floor.

The runtime, the model gateway (scripted model, zero latency) and authz run as real
processes. The agent's FOLLOW_ROOM waits for confirmation (``CONFIRM_ACTIONS``), so each
"please follow" message leaves one pending approval. The benchmark then approves them
over NATS (authz ``Decide``, as the CHOICE action does) and times each approval until its
``TOOL_CALL_SETTLED`` event arrives: authz records the decision and publishes the claim
event, a runtime replica consumes it, writes the effect claim, runs the handler, records
the result and settles, and authz publishes the settlement. Sequential, and 16 in flight.

The floor is measured in the same run (bench/turn_latency.py's raw legs): the legs an
approval cannot avoid are two NATS request/replies (Decide, Settle), two JetStream
publish→consume round trips (the claim and settlement events) and four single SQL
statements (decide, effect claim, effect result, settle); the ratio compares the p50s.

Usage: python bench/confirmations.py [--approvals 300] [--in-flight 16]
"""

from __future__ import annotations

import argparse
import asyncio
import secrets
import time
import uuid
from pathlib import Path
from typing import Any

import yaml
from _common import ROOT, Series, bench_env, report, service_process, suite_env
from turn_latency import floors

from parley.v1 import authz_pb2, runtime_pb2
from parley_devinfra.infra import free_port
from parley_platform.bus import Bus
from parley_platform.rpc import RpcClient
from parley_platform.testing import ServiceProcess

AGENT_ID = uuid.uuid5(uuid.UUID("6f1f3f3e-6a0c-5b8e-9a57-5061726c6579"), "agent:default")
SOURCE = "bench"
RULES = [
    {
        "match": "(?s)# Current message\\n[^\\n:]*: please follow",
        "actions": ["FOLLOW_ROOM"],
        "text": "",
    },
    {"match": "(?s)# Current message\\n[^\\n:]*: The actions waiting", "text": "Done."},
]


def tool_call_id(message_id: str) -> str:
    turn = uuid.uuid5(AGENT_ID, f"{SOURCE}:message:{message_id}")
    return f"{turn}:0"


class Approvals:
    """Proposes approvals through real turns, then approves them and waits for each settlement."""

    def __init__(self, bus: Bus) -> None:
        self.bus = bus
        self.rpc = RpcClient(bus)
        self.prompts: dict[str, asyncio.Future[None]] = {}
        self.settled: dict[str, asyncio.Future[None]] = {}
        self.ready: list[str] = []

    async def start(self) -> None:
        async def on_reply(msg: Any) -> None:
            reply = runtime_pb2.OutboundMessage.FromString(msg.data)
            future = self.prompts.pop(reply.in_reply_to, None)
            if future and not future.done() and reply.text.startswith("Before I go ahead"):
                future.set_result(None)

        async def on_settled(msg: Any) -> None:
            event = authz_pb2.ToolCallEvent.FromString(msg.data)
            future = self.settled.pop(event.tool_call.tool_call_id, None)
            if future and not future.done():
                future.set_result(None)

        subjects = self.bus.subjects
        await self.bus.nc.subscribe(subjects.outbound(str(AGENT_ID), SOURCE), cb=on_reply)
        await self.bus.nc.subscribe(subjects.events(str(AGENT_ID), "TOOL_CALL_SETTLED"), cb=on_settled)

    async def propose(self, count: int) -> None:
        async def one(i: int) -> None:
            message_id = secrets.token_hex(8)
            future = asyncio.get_running_loop().create_future()
            self.prompts[message_id] = future
            inbound = runtime_pb2.InboundMessage(
                agent_id=str(AGENT_ID),
                source=SOURCE,
                message_id=message_id,
                sender_id=f"user-{i}",
                sender_name=f"User {i}",
                channel_id=f"room-{i}",
                room_type=runtime_pb2.ROOM_TYPE_DM,
                text="please follow this room",
            )
            await self.bus.publish(
                self.bus.subjects.inbound(str(AGENT_ID), SOURCE),
                inbound.SerializeToString(),
                msg_id=f"{SOURCE}:{message_id}",
            )
            await asyncio.wait_for(future, 60)
            self.ready.append(tool_call_id(message_id))

        for start in range(0, count, 64):
            await asyncio.gather(*(one(i) for i in range(start, min(count, start + 64))))

    async def approve(self, call_id: str) -> None:
        future = asyncio.get_running_loop().create_future()
        self.settled[call_id] = future
        reply = await self.rpc.call(
            "authz",
            "Decide",
            authz_pb2.DecideRequest(
                agent_id=str(AGENT_ID),
                tool_call_id=call_id,
                decision=authz_pb2.TOOL_DECISION_APPROVE,
                decided_by="bench",
            ),
            authz_pb2.DecideResponse,
            timeout=10,
        )
        assert reply.result == authz_pb2.DECIDE_RESULT_CLAIMED, reply
        await asyncio.wait_for(future, 30)


async def timed(name: str, calls: list[str], in_flight: int, approvals: Approvals) -> Series:
    latencies: list[float] = []
    queue = list(reversed(calls))

    async def worker() -> None:
        while queue:
            call_id = queue.pop()
            started = time.perf_counter()
            await approvals.approve(call_id)
            latencies.append(time.perf_counter() - started)

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(in_flight)))
    return Series(name, latencies, time.perf_counter() - started)


def characters(directory: Path) -> Path:
    character = yaml.safe_load((ROOT / "characters" / "default.yaml").read_text())
    character["settings"] = {**(character.get("settings") or {}), "CONFIRM_ACTIONS": "FOLLOW_ROOM"}
    character["settings"]["REFLECTION"] = False
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "default.yaml").write_text(yaml.safe_dump(character))
    return directory


async def main(args: argparse.Namespace) -> None:
    with bench_env() as env:
        rules = env.logs.parent / "rules.yaml"
        rules.parent.mkdir(parents=True, exist_ok=True)
        rules.write_text(yaml.safe_dump(RULES))
        settings = {
            **suite_env(env),
            "PARLEY_CHARACTERS_DIR": str(characters(env.logs.parent / "characters")),
            "PARLEY_SCRIPTED_RULES": str(rules),
            "PARLEY_EMBED_MESSAGES": "false",
        }
        gateway = service_process("parley_gateway", env, settings, "gateway").start()
        runtime = service_process("parley_runtime", env, settings, "runtime").start()
        authz_port = free_port()
        authz = ServiceProcess(
            "parley_authz",
            {
                **settings,
                "PARLEY_AUTHZ_GRPC_PORT": str(authz_port),
                "PARLEY_AUTHZ_METRICS_PORT": str(free_port()),
            },
            env.logs / "authz.log",
            authz_port,
        ).start()
        bus = await Bus.connect(env.nats_url, name="bench", namespace=env.namespace)
        try:
            for process in (gateway, runtime, authz):
                await process.wait_ready()
            approvals = Approvals(bus)
            await approvals.start()
            total = 20 + args.approvals + args.approvals * 2
            await approvals.propose(total)
            calls = approvals.ready
            await timed("warm-up", calls[:20], 1, approvals)
            sequential = await timed(
                "approval → settled, sequential", calls[20 : 20 + args.approvals], 1, approvals
            )
            concurrent = await timed(
                f"approval → settled, {args.in_flight} in flight",
                calls[20 + args.approvals :],
                args.in_flight,
                approvals,
            )
            floor = await floors(env, bus, args.approvals, args.in_flight)
        finally:
            await bus.close()
            for process in (authz, runtime, gateway):
                process.stop()

    def p50(key: str) -> float:
        return floor[key].p50_ms

    floor_ms = 2 * p50("nats request/reply:1") + 2 * p50("js publish→consume:1") + 4 * p50("sql statement:1")
    summary = {
        "benchmark": "confirmations",
        "approval_sequential": sequential.figures(),
        "approval_concurrent": {**concurrent.figures(), "in_flight": args.in_flight},
        "floor": {key: series.figures() for key, series in floor.items()},
        "floor_approval_p50_ms": round(floor_ms, 3),
        "ratio_to_floor": round(sequential.p50_ms / floor_ms, 2),
    }
    report(
        "Confirmed actions: approval to settlement (1 runtime, 1 authz, scripted model)",
        [sequential, concurrent, *floor.values()],
        summary,
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--approvals", type=int, default=300)
    parser.add_argument("--in-flight", type=int, default=16)
    asyncio.run(main(parser.parse_args()))
