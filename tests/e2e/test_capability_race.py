"""Capability authorization runs once per approval: 20 runtime-side clients (each its own NATS
connection with the runtime's identity, in 4 processes) race one approval through the runtime's own
``CapabilityGate`` against the real authz service, and the action runs exactly once. A decision
whose account snapshot went stale is burned: the action reports it, and reconnecting the account
does not revive it."""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import sys
import textwrap
import uuid
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from racing import Span, assert_raced

from parley.v1 import authz_pb2
from parley.v1.authz_nats import AuthzClient
from parley_platform.bus import Bus
from parley_platform.rpc import RpcClient
from parley_runtime.sdk import Action, Capability
from parley_runtime.turn.capabilities import CapabilityGate, Refused
from support import SessionEnv, Suite

PROCESSES, PER_PROCESS = 4, 5
ACCOUNT, SNAPSHOT = "acct-race", "snap-1"

RACER = textwrap.dedent(
    """
    import asyncio, json, sys, time, uuid
    from pathlib import Path
    from types import SimpleNamespace
    from parley.v1 import authz_pb2
    from parley.v1.authz_nats import AuthzClient
    from parley_platform.bus import Bus
    from parley_platform.rpc import RpcClient
    from parley_runtime.sdk import Action, ActionResult, Capability
    from parley_runtime.turn.capabilities import Approval, CapabilityGate, Refused

    url, namespace, clients, agent_id, ran_file = sys.argv[1:]
    SETTINGS = {"CAPABILITY_PAYMENTS_TRANSFER_ACCOUNT": "acct-race",
                "CAPABILITY_PAYMENTS_TRANSFER_SNAPSHOT": "snap-1"}
    AGENT = SimpleNamespace(id=uuid.UUID(agent_id), setting=SETTINGS.get,
                            redactor=SimpleNamespace(redact=lambda text: text))

    async def pay(ctx, params, callback):
        raise AssertionError("the gate runs the handler it is given")

    ACTION = Action("PAY", "pays", pay, capability=Capability("payments.transfer", "create", "R3"))

    async def one(gate, job, barrier, client):
        async def handler():
            with Path(ran_file).open("a") as f:
                f.write(f"{job['round']} {client}\\n")
            return ActionResult(True), "success"

        await barrier.wait()
        start = time.monotonic()
        if job["mode"] == "approval":
            approval = Approval(authz_pb2.CapabilityRequest.FromString(bytes.fromhex(job["request"])),
                                job["decision_id"], job["decision_digest"])
            try:
                await gate.authorize(approval)
                _, outcome = await handler()
            except Refused as refused:
                outcome = refused.code
        else:
            result, outcome = await gate.run(AGENT, ACTION, job["params"], job["decision_id"], handler)
            outcome = outcome if result.success else result.error.split(":")[0]
        return {"outcome": outcome, "start": start, "end": time.monotonic()}

    async def main():
        buses = [await Bus.connect(url, name="runtime", namespace=namespace) for _ in range(int(clients))]
        gates = [CapabilityGate(AuthzClient(RpcClient(bus), timeout=60)) for bus in buses]
        try:
            while True:
                print("ready", flush=True)
                line = (await asyncio.to_thread(sys.stdin.readline)).strip()
                if not line:
                    return
                job = json.loads(line)
                barrier = asyncio.Barrier(len(gates))
                results = await asyncio.gather(
                    *(one(gate, job, barrier, f"{id(gate)}") for gate in gates))
                print(json.dumps(results), flush=True)
        finally:
            for bus in buses:
                await bus.close()

    asyncio.run(main())
    """
)


class Racers:
    def __init__(self, processes: list[asyncio.subprocess.Process]) -> None:
        self.processes = processes

    @classmethod
    async def start(cls, env: SessionEnv, namespace: str, agent: str, ran: Path) -> Racers:
        child_env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
        started = [
            await asyncio.create_subprocess_exec(
                sys.executable,
                "-c",
                RACER,
                env.url_for("runtime"),
                namespace,
                str(PER_PROCESS),
                agent,
                str(ran),
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                env=child_env,
            )
            for _ in range(PROCESSES)
        ]
        racers = cls(started)
        for process in started:
            assert await racers._line(process) == "ready"
        return racers

    async def _line(self, process: asyncio.subprocess.Process) -> str:
        assert process.stdout is not None
        line = await asyncio.wait_for(process.stdout.readline(), 120)
        assert line, f"racer {process.pid} exited with {await process.wait()}"
        return line.decode().strip()

    async def race(self, job: dict[str, Any]) -> Counter[str]:
        line = (json.dumps(job) + "\n").encode()
        for process in self.processes:
            assert process.stdin is not None
            process.stdin.write(line)
            await process.stdin.drain()
        results: list[dict[str, Any]] = []
        for process in self.processes:
            results += json.loads(await self._line(process))
            assert await self._line(process) == "ready"
        assert len(results) == PROCESSES * PER_PROCESS
        assert_raced((Span(r["start"], r["end"]) for r in results), f"{job['mode']} racers")
        return Counter(r["outcome"] for r in results)

    async def stop(self) -> None:
        for process in self.processes:
            assert process.stdin is not None
            process.stdin.close()
        for process in self.processes:
            await asyncio.wait_for(process.wait(), 30)


class Agent:
    """What the gate reads of an agent: its id, its settings, its redactor."""

    def __init__(self, agent_id: uuid.UUID) -> None:
        self.id = agent_id
        self.settings = {
            "CAPABILITY_PAYMENTS_TRANSFER_ACCOUNT": ACCOUNT,
            "CAPABILITY_PAYMENTS_TRANSFER_SNAPSHOT": SNAPSHOT,
        }

        class Redactor:
            @staticmethod
            def redact(text: str) -> str:
                return text

        self.redactor = Redactor()

    def setting(self, key: str) -> object | None:
        return self.settings.get(key)


@pytest.fixture
async def authz(test_env: SessionEnv, tmp_path: Path) -> AsyncIterator[tuple[Suite, AuthzClient, Bus]]:
    suite = Suite(test_env, tmp_path / "logs", f"c{secrets.token_hex(4)}")
    await suite.add_service("parley_authz", "AUTHZ")
    bus = await Bus.connect(test_env.url_for("runtime"), name="runtime", namespace=suite.namespace)
    try:
        yield suite, AuthzClient(RpcClient(bus), timeout=30), bus
    finally:
        await bus.close()
        suite.stop()


@pytest.mark.slow
async def test_20_runtime_clients_racing_one_approval_run_the_action_once(
    authz: tuple[Suite, AuthzClient, Bus], test_env: SessionEnv, tmp_path: Path
) -> None:
    suite, client, _ = authz
    agent_id = uuid.uuid4()
    agent: Any = Agent(agent_id)
    operator = await Bus.connect(test_env.nats_url, name="tests", namespace=suite.namespace)
    operator_authz = AuthzClient(RpcClient(operator), timeout=30)
    await operator_authz.PutAccountSnapshot(
        authz_pb2.PutAccountSnapshotRequest(
            agent_id=str(agent_id), account_id=ACCOUNT, snapshot_version=SNAPSHOT
        )
    )

    async def never(*_: Any) -> Any:
        raise AssertionError("not run")

    action = Action("PAY", "pays", never, capability=Capability("payments.transfer", "create", "R3"))
    gate = CapabilityGate(client)
    ran = tmp_path / "ran.log"
    racers = await Racers.start(test_env, suite.namespace, str(agent_id), ran)
    try:
        for round_ in range(5):
            # One approval (the runtime's registered decision for these exact parameters), 20 racers.
            approval = await gate.approve(agent, action, {"invoice": f"a-{round_}"}, f"approval-{round_}")
            counted = await racers.race(
                {
                    "mode": "approval",
                    "round": f"a{round_}",
                    "request": approval.request.SerializeToString().hex(),
                    "decision_id": approval.decision_id,
                    "decision_digest": approval.decision_digest,
                }
            )
            assert counted == {"success": 1, "STALE_CAPABILITY_AUTHORIZATION": 19}, counted
            # 20 replicas running the same approved call (one decision id) from the start.
            counted = await racers.race(
                {
                    "mode": "run",
                    "round": f"r{round_}",
                    "params": {"invoice": "r"},
                    "decision_id": f"call-{round_}",
                }
            )
            assert counted["success"] == 1, counted
            assert sum(counted.values()) == 20
        lines = ran.read_text().splitlines()
        per_round = Counter(line.split()[0] for line in lines)
        assert per_round == {f"{kind}{n}": 1 for kind in "ar" for n in range(5)}, per_round
    finally:
        await racers.stop()

    # A stale snapshot burns the authority: the account reconnects under a new snapshot, the
    # decision given before is refused and gone, and reconnecting does not bring it back.
    approval = await gate.approve(agent, action, {"invoice": "late"}, "approval-late")
    await operator_authz.PutAccountSnapshot(
        authz_pb2.PutAccountSnapshotRequest(
            agent_id=str(agent_id), account_id=ACCOUNT, snapshot_version="snap-2"
        )
    )
    with pytest.raises(Refused) as caught:
        await gate.authorize(approval)
    assert caught.value.code == "STALE_CAPABILITY_AUTHORIZATION"
    await operator_authz.RevokeAccountSnapshot(
        authz_pb2.RevokeAccountSnapshotRequest(agent_id=str(agent_id), account_id=ACCOUNT)
    )
    await operator_authz.PutAccountSnapshot(
        authz_pb2.PutAccountSnapshotRequest(
            agent_id=str(agent_id), account_id=ACCOUNT, snapshot_version="snap-3"
        )
    )
    with pytest.raises(Refused) as again:
        await gate.authorize(approval)
    assert again.value.code == "STALE_CAPABILITY_AUTHORIZATION"
    # And through gate.run the action reports it instead of running.
    result, outcome = await gate.run(agent, action, {"invoice": "late"}, "approval-late-2", never)
    assert outcome == "stale"
    assert result.error is not None
    assert result.error.startswith("STALE_CAPABILITY_AUTHORIZATION")
    await operator.close()
