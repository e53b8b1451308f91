"""Capability authorization in the turn: what running an action through authz's one-shot
``Authorize`` costs, against its floor.

authz runs as a real process; the runtime's own ``CapabilityGate`` (with the runtime's NATS
identity) runs an action with a capability: bind the request for its exact parameters, register the
runtime's decision, authorize it (the one-shot compare-and-delete), run the handler (a no-op
here), record the receipt. Sequential, and N in flight. A race of 20 clients over one approval
counts how many ran (always 1).

The floor, measured in the same run (bench/turn_latency.py's raw legs): the legs this cannot
avoid are four NATS request/replies (bind, register, authorize, receipt) and three single SQL
statements (register, authorize, receipt); the ratio compares the p50s.

Usage: python bench/capabilities.py [--runs 300] [--in-flight 16] [--racers 20]
"""

from __future__ import annotations

import argparse
import asyncio
import time
import uuid
from types import SimpleNamespace
from typing import Any

from _common import Series, bench_env, report, suite_env
from turn_latency import floors

from parley.v1 import authz_pb2
from parley.v1.authz_nats import AuthzClient
from parley_devinfra.infra import free_port
from parley_platform.bus import Bus
from parley_platform.rpc import RpcClient
from parley_platform.testing import ServiceProcess
from parley_runtime.sdk import Action, ActionResult, Capability
from parley_runtime.turn.capabilities import CapabilityGate, Refused

ACCOUNT, SNAPSHOT = "acct-bench", "snap-1"
SETTINGS = {
    "CAPABILITY_PAYMENTS_TRANSFER_ACCOUNT": ACCOUNT,
    "CAPABILITY_PAYMENTS_TRANSFER_SNAPSHOT": SNAPSHOT,
}


async def _never(*_: Any) -> ActionResult:
    raise AssertionError("the gate runs the handler it is given")


ACTION = Action("PAY", "pays", _never, capability=Capability("payments.transfer", "create", "R3"))


async def noop() -> tuple[ActionResult, str]:
    return ActionResult(True), "success"


async def timed(name: str, gate: CapabilityGate, agent: Any, n: int, in_flight: int) -> Series:
    latencies: list[float] = []
    counter = iter(range(n))

    async def worker() -> None:
        for i in counter:
            started = time.perf_counter()
            result, _ = await gate.run(agent, ACTION, {"invoice": i}, uuid.uuid4().hex, noop)
            assert result.success, result.error
            latencies.append(time.perf_counter() - started)

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(in_flight)))
    return Series(name, latencies, time.perf_counter() - started)


async def race(gates: list[CapabilityGate], agent: Any) -> int:
    """Racers over one approval: how many ran the action."""
    approval = await gates[0].approve(agent, ACTION, {"invoice": "race"}, uuid.uuid4().hex)
    ran = 0

    async def one(gate: CapabilityGate) -> None:
        nonlocal ran
        try:
            await gate.authorize(approval)
        except Refused:
            return
        ran += 1

    await asyncio.gather(*(one(gate) for gate in gates))
    return ran


async def main(args: argparse.Namespace) -> None:
    with bench_env() as env:
        settings = suite_env(env)
        port = free_port()
        authz = ServiceProcess(
            "parley_authz",
            {**settings, "PARLEY_AUTHZ_GRPC_PORT": str(port), "PARLEY_AUTHZ_METRICS_PORT": str(free_port())},
            env.logs / "authz.log",
            port,
        ).start()
        runtime_url = env.endpoints.nats_url_for("runtime")
        bus = await Bus.connect(env.nats_url, name="bench", namespace=env.namespace)
        racers = [
            await Bus.connect(runtime_url, name="runtime", namespace=env.namespace)
            for _ in range(args.racers)
        ]
        try:
            await authz.wait_ready()
            agent = SimpleNamespace(
                id=uuid.uuid4(), setting=SETTINGS.get, redactor=SimpleNamespace(redact=lambda text: text)
            )
            await AuthzClient(RpcClient(bus), timeout=30).PutAccountSnapshot(
                authz_pb2.PutAccountSnapshotRequest(
                    agent_id=str(agent.id), account_id=ACCOUNT, snapshot_version=SNAPSHOT
                )
            )
            gates = [CapabilityGate(AuthzClient(RpcClient(b), timeout=30)) for b in racers]
            await timed("warm-up", gates[0], agent, 20, 1)
            sequential = await timed("authorized action, sequential", gates[0], agent, args.runs, 1)
            concurrent = await timed(
                f"authorized action, {args.in_flight} in flight", gates[0], agent, args.runs, args.in_flight
            )
            ran = [await race(gates, agent) for _ in range(5)]
            floor = await floors(env, bus, args.runs, args.in_flight)
        finally:
            await bus.close()
            for racer in racers:
                await racer.close()
            authz.stop()

    floor_ms = 4 * floor["nats request/reply:1"].p50_ms + 3 * floor["sql statement:1"].p50_ms
    summary = {
        "benchmark": "capabilities",
        "authorized_sequential": sequential.figures(),
        "authorized_concurrent": {**concurrent.figures(), "in_flight": args.in_flight},
        "floor": {key: series.figures() for key, series in floor.items()},
        "floor_authorized_p50_ms": round(floor_ms, 3),
        "ratio_to_floor": round(sequential.p50_ms / floor_ms, 2),
        "race_racers": args.racers,
        "race_runs_per_approval_max": max(ran),
    }
    assert ran == [1] * 5, ran
    report(
        "Capability authorization: bind, decide, authorize once, receipt (1 authz)",
        [sequential, concurrent, *floor.values()],
        summary,
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=300)
    parser.add_argument("--in-flight", type=int, default=16)
    parser.add_argument("--racers", type=int, default=20)
    asyncio.run(main(parser.parse_args()))
