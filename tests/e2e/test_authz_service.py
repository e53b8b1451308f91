"""The authz service as real processes: two replicas serving gRPC (operators) and NATS (services),
raced by client processes, an executor killed between claim and settle, the `parley approvals` and
`parley leases` commands, the decision events and the metrics."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import textwrap
import time
import urllib.request
import uuid
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import psycopg
import pytest
from google.protobuf.message import Message
from google.protobuf.timestamp_pb2 import Timestamp
from grpc_health.v1 import health_pb2, health_pb2_grpc
from nats.js.api import ConsumerConfig, DeliverPolicy
from racing import Span, assert_raced

from parley.v1 import authz_pb2, authz_pb2_grpc, common_pb2
from parley_devinfra.infra import free_port
from parley_platform import canonical, frames
from parley_platform.bus import Bus
from parley_platform.errors import ParleyError
from parley_platform.rpc import RpcClient
from parley_platform.testing import ServiceProcess, eventually
from support import SessionEnv

PARLEY = str(Path(sys.executable).parent / "parley")


@dataclass
class Replica:
    process: ServiceProcess
    grpc_port: int
    metrics_port: int


def start_replica(test_env: SessionEnv, logs: Path, **settings: str) -> Replica:
    """An authz process on ports of its own, with ``settings`` over the test environment."""
    grpc_port, metrics_port = free_port(), free_port()
    env = test_env.service_env(
        PARLEY_AUTHZ_GRPC_PORT=str(grpc_port), PARLEY_AUTHZ_METRICS_PORT=str(metrics_port), **settings
    )
    process = ServiceProcess("parley_authz", env, logs / f"authz-{grpc_port}.log", grpc_port).start()
    return Replica(process, grpc_port, metrics_port)


@pytest.fixture(scope="module")
async def replicas(
    test_env: SessionEnv, tmp_path_factory: pytest.TempPathFactory, bus: Bus
) -> AsyncIterator[list[Replica]]:
    logs = tmp_path_factory.mktemp("authz-logs")
    started: list[Replica] = []
    try:
        for _ in range(2):
            started.append(
                start_replica(
                    test_env,
                    logs,
                    PARLEY_AUTHZ_SWEEP_INTERVAL_SECONDS="0.2",
                    PARLEY_AUTHZ_GAUGE_INTERVAL_SECONDS="0.2",
                    PARLEY_DB_POOL_MAX="12",
                )
            )
        for replica in started:
            await replica.process.wait_ready()
        yield started
    finally:
        for replica in started:
            replica.process.stop()


@pytest.fixture
async def stub(replicas: list[Replica]) -> AsyncIterator[authz_pb2_grpc.AuthzStub]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{replicas[0].grpc_port}") as channel:
        yield authz_pb2_grpc.AuthzStub(channel)


@pytest.fixture
def rpc(bus: Bus, replicas: list[Replica]) -> RpcClient:
    return RpcClient(bus)


@pytest.fixture
def agent() -> str:
    return str(uuid.uuid4())


def auth(test_env: SessionEnv) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {test_env.token}")]


def pending(agent: str, tool_call_id: str, **extra: Any) -> authz_pb2.PutPendingRequest:
    return authz_pb2.PutPendingRequest(
        agent_id=agent,
        tool_call_id=tool_call_id,
        conversation_id=extra.pop("conversation_id", "room-1"),
        message_id=extra.pop("message_id", f"m-{tool_call_id}"),
        tool="SEND_EMAIL",
        args_digest=canonical.tool_arguments_digest({"to": "bob"}),
        summary="email bob the report",
        **extra,
    )


def approve(agent: str, tool_call_id: str, by: str = "e2e") -> authz_pb2.DecideRequest:
    return authz_pb2.DecideRequest(
        agent_id=agent, tool_call_id=tool_call_id, decision=authz_pb2.TOOL_DECISION_APPROVE, decided_by=by
    )


async def call(rpc: RpcClient, method: str, request: Message, response: type[Any]) -> Any:
    return await rpc.call("authz", method, request, response, timeout=10)


# ----- gRPC and NATS: one contract, one set of error codes ------------------------------------------


async def test_grpc_requires_the_token_and_health_is_open(
    replicas: list[Replica], stub: authz_pb2_grpc.AuthzStub, test_env: SessionEnv, agent: str
) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{replicas[1].grpc_port}") as channel:
        health = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service="parley.v1.Authz"), timeout=5
        )
        assert health.status == health_pb2.HealthCheckResponse.SERVING
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await stub.GetToolCall(authz_pb2.GetToolCallRequest(agent_id=agent, tool_call_id="x"), timeout=5)
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED


@pytest.mark.parametrize(
    ("method", "request_", "status", "code", "mentions"),
    [
        (
            "GetToolCall",
            authz_pb2.GetToolCallRequest(agent_id="default", tool_call_id="x"),
            grpc.StatusCode.INVALID_ARGUMENT,
            "INVALID_ARGUMENT",
            "agent_id must be a UUID",
        ),
        (
            "Decide",
            approve(str(uuid.UUID(int=1)), "nobody"),
            grpc.StatusCode.NOT_FOUND,
            "ACTION_NOT_FOUND",
            "no tool call",
        ),
        (
            "Authorize",
            authz_pb2.AuthorizeRequest(request=authz_pb2.CapabilityRequest(version=7)),
            grpc.StatusCode.INVALID_ARGUMENT,
            "INVALID_CONTRACT",
            "request.version must be 1",
        ),
        (
            "AssertLeases",
            authz_pb2.AssertLeasesRequest(agent_id=str(uuid.UUID(int=1)), session_id="s", owner="o"),
            grpc.StatusCode.INVALID_ARGUMENT,
            "LEASE_REQUIREMENTS_MISSING",
            "required is missing",
        ),
    ],
)
async def test_errors_map_to_the_same_codes_over_grpc_and_nats(
    stub: authz_pb2_grpc.AuthzStub,
    rpc: RpcClient,
    test_env: SessionEnv,
    method: str,
    request_: Message,
    status: grpc.StatusCode,
    code: str,
    mentions: str,
) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as over_grpc:
        await getattr(stub, method)(request_, metadata=auth(test_env), timeout=10)
    assert over_grpc.value.code() == status
    assert code in (over_grpc.value.details() or "")
    assert mentions in (over_grpc.value.details() or "")
    with pytest.raises(ParleyError) as over_nats:
        await call(rpc, method, request_, authz_pb2.ToolCall)
    assert over_nats.value.code == code
    assert mentions in over_nats.value.message


async def test_an_undecodable_request_is_refused_and_the_service_keeps_serving(
    bus: Bus, rpc: RpcClient, agent: str
) -> None:
    subject = bus.subjects.rpc("authz", "Decide")
    # Bytes in the envelope that are no DecideRequest, and bytes in no envelope at all.
    for garbage in (
        frames.request(b"\xff\xff\xff not protobuf", deadline=None),
        b"\xff\xff\xff not protobuf",
    ):
        reply = await bus.nc.request(subject, garbage, timeout=10)
        status, body = frames.parse_reply(reply.data)
        assert status == frames.ERROR
        error = common_pb2.Error.FromString(body)
        assert error.code == "INVALID_PAYLOAD"
        assert "parley.v1.DecideRequest" in error.message
    put = await call(rpc, "PutPending", pending(agent, "after-garbage"), authz_pb2.PutPendingResponse)
    assert put.created


async def test_conflicts_are_aborted_and_stale_authority_a_failed_precondition(
    stub: authz_pb2_grpc.AuthzStub, test_env: SessionEnv, agent: str
) -> None:
    metadata = auth(test_env)
    await stub.PutPending(pending(agent, "g-1"), metadata=metadata, timeout=10)
    await stub.Decide(
        authz_pb2.DecideRequest(
            agent_id=agent, tool_call_id="g-1", decision=authz_pb2.TOOL_DECISION_DENY, decided_by="op"
        ),
        metadata=metadata,
        timeout=10,
    )
    with pytest.raises(grpc.aio.AioRpcError) as conflict:
        await stub.Decide(approve(agent, "g-1"), metadata=metadata, timeout=10)
    assert conflict.value.code() == grpc.StatusCode.ABORTED
    assert "ACTION_ALREADY_DECIDED" in (conflict.value.details() or "")
    with pytest.raises(grpc.aio.AioRpcError) as stale:
        await stub.Settle(
            authz_pb2.SettleRequest(
                agent_id=agent,
                tool_call_id="g-1",
                claim_token=str(uuid.uuid4()),
                outcome=authz_pb2.TOOL_OUTCOME_SUCCESS,
                settled_by="x",
            ),
            metadata=metadata,
            timeout=10,
        )
    assert stale.value.code() == grpc.StatusCode.FAILED_PRECONDITION


# ----- races with client processes over NATS ----------------------------------------------------------

RACER = textwrap.dedent(
    """
    import asyncio, json, sys, time
    from parley.v1 import authz_pb2
    from parley_platform.bus import Bus
    from parley_platform.errors import ParleyError
    from parley_platform.rpc import RpcClient

    TYPES = {
        "Decide": (authz_pb2.DecideRequest, authz_pb2.DecideResponse),
        "Authorize": (authz_pb2.AuthorizeRequest, authz_pb2.AuthorizeResponse),
    }

    async def one(rpc, method, request, barrier):
        # Every client waits here, then says when its call started and ended (time.monotonic is
        # one clock for every process), so the test can check that the calls overlapped.
        await barrier.wait()
        span = {"start": time.monotonic()}
        try:
            reply = await rpc.call("authz", method, request, TYPES[method][1], timeout=60)
        except ParleyError as exc:
            return {"error": exc.code, **span, "end": time.monotonic()}
        span["end"] = time.monotonic()
        return {**span, **await outcome(rpc, method, request, reply)}

    async def outcome(rpc, method, request, reply):
        if method == "Decide" and reply.result == authz_pb2.DECIDE_RESULT_CLAIMED:
            # The winner is the executor: the tool runs here, once, then the claim is settled.
            await rpc.call("authz", "Settle", authz_pb2.SettleRequest(
                agent_id=request.agent_id, tool_call_id=request.tool_call_id,
                claim_token=reply.tool_call.claim.token, outcome=authz_pb2.TOOL_OUTCOME_SUCCESS,
                result="ran", settled_by="racer"), authz_pb2.ToolCall, timeout=60)
            return {"ok": "executed"}
        if method == "Decide":
            return {"ok": authz_pb2.DecideResult.Name(reply.result)}
        return {"ok": "authorized"}

    async def main(url, namespace, clients):
        buses = [await Bus.connect(url, name="racer", namespace=namespace) for _ in range(clients)]
        rpcs = [RpcClient(bus) for bus in buses]
        try:
            while True:
                print("ready", flush=True)
                line = (await asyncio.to_thread(sys.stdin.readline)).strip()
                if not line:
                    return
                method, payload = line.split(" ", 1)
                request = TYPES[method][0].FromString(bytes.fromhex(payload))
                barrier = asyncio.Barrier(len(rpcs))
                results = await asyncio.gather(*(one(rpc, method, request, barrier) for rpc in rpcs))
                print(json.dumps(results), flush=True)
        finally:
            for bus in buses:
                await bus.close()

    asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3])))
    """
)


class NatsRacers:
    """Client processes, each with its own NATS connections, released together one round at a time."""

    def __init__(self, processes: list[asyncio.subprocess.Process], clients: int) -> None:
        self.processes = processes
        self.clients = clients

    @classmethod
    async def start(cls, env: SessionEnv, processes: int, per_process: int) -> NatsRacers:
        child_env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
        started = [
            await asyncio.create_subprocess_exec(
                sys.executable,
                "-c",
                RACER,
                env.nats_url,
                env.namespace,
                str(per_process),
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                env=child_env,
            )
            for _ in range(processes)
        ]
        racers = cls(started, processes * per_process)
        await racers._ready()
        return racers

    async def _line(self, process: asyncio.subprocess.Process) -> str:
        assert process.stdout is not None
        line = await asyncio.wait_for(process.stdout.readline(), 120)
        assert line, f"racer {process.pid} exited with {await process.wait()}"
        return line.decode().strip()

    async def _ready(self) -> None:
        for process in self.processes:
            assert await self._line(process) == "ready"

    async def race(self, method: str, request: Message) -> Counter[str]:
        line = f"{method} {request.SerializeToString().hex()}\n".encode()
        for process in self.processes:
            assert process.stdin is not None
            process.stdin.write(line)
        await asyncio.gather(*(p.stdin.drain() for p in self.processes if p.stdin))
        results: list[dict[str, Any]] = []
        for process in self.processes:
            results += json.loads(await self._line(process))
        await self._ready()
        assert len(results) == self.clients, results
        assert_raced((Span(r["start"], r["end"]) for r in results), f"{method} racers")
        return Counter(r.get("ok") or r["error"] for r in results)

    async def stop(self) -> None:
        for process in self.processes:
            if process.stdin is not None:
                process.stdin.close()
        for process in self.processes:
            try:
                await asyncio.wait_for(process.wait(), 15)
            except TimeoutError:
                process.kill()
                await process.wait()


@pytest.mark.slow
async def test_100_rounds_of_100_concurrent_decides_claim_and_execute_once(
    replicas: list[Replica], rpc: RpcClient, test_env: SessionEnv, agent: str
) -> None:
    racers = await NatsRacers.start(test_env, processes=4, per_process=25)
    try:
        executed = 0
        for round_ in range(100):
            tool_call_id = f"race-{round_}"
            await call(rpc, "PutPending", pending(agent, tool_call_id), authz_pb2.PutPendingResponse)
            counted = await racers.race("Decide", approve(agent, tool_call_id, by=f"racer-{round_}"))
            assert counted["executed"] == 1, (round_, counted)
            assert counted["DECIDE_RESULT_IN_FLIGHT"] + counted["DECIDE_RESULT_RECORDED"] == 99, (
                round_,
                counted,
            )
            executed += counted["executed"]
        assert executed == 100
    finally:
        await racers.stop()
    for round_ in (0, 57, 99):
        record = await call(
            rpc,
            "GetToolCall",
            authz_pb2.GetToolCallRequest(agent_id=agent, tool_call_id=f"race-{round_}"),
            authz_pb2.ToolCall,
        )
        assert record.outcome == authz_pb2.TOOL_OUTCOME_SUCCESS
        assert record.result == "ran"


def ms(value: int) -> Timestamp:
    return Timestamp(seconds=value // 1000, nanos=(value % 1000) * 1_000_000)


async def register_decision(
    rpc: RpcClient,
    agent: str,
    decision_id: str,
    *,
    capability: str,
    risk: authz_pb2.RiskLevel.ValueType,
    inputs: dict[str, Any],
    confirmation_id: str = "",
    ttl_ms: int = 60_000,
) -> tuple[authz_pb2.CapabilityRequest, authz_pb2.PolicyDecision]:
    """A request of ``agent`` on account ``acct`` (snapshot ``s1``) and a policy decision for it,
    registered over NATS: allowed, or waiting for ``confirmation_id``."""
    now = int(time.time() * 1000)
    request = authz_pb2.CapabilityRequest(
        version=1,
        agent_id=agent,
        account_id="acct",
        snapshot_version="s1",
        capability=capability,
        operation="create",
        catalog_risk=risk,
        risk=risk,
        input_digest=canonical.tool_arguments_digest(inputs),
        bound_at=ms(now - 10),
    )
    allowed, waiting = authz_pb2.POLICY_OUTCOME_ALLOWED, authz_pb2.POLICY_OUTCOME_CONFIRMATION_REQUIRED
    decision = authz_pb2.PolicyDecision(
        version=1,
        decision_id=decision_id,
        request_digest=canonical.request_digest(request),
        outcome=waiting if confirmation_id else allowed,
        confirmation_id=confirmation_id,
        issued_at=ms(now),
        expires_at=ms(now + ttl_ms),
    )
    decision.digest = canonical.decision_digest(decision)
    await call(
        rpc,
        "RegisterDecision",
        authz_pb2.RegisterDecisionRequest(request=request, decision=decision),
        authz_pb2.RegisterDecisionResponse,
    )
    return request, decision


@pytest.mark.slow
async def test_64_concurrent_authorizes_of_one_decision_succeed_once(
    replicas: list[Replica], rpc: RpcClient, test_env: SessionEnv, agent: str
) -> None:
    await call(
        rpc,
        "PutAccountSnapshot",
        authz_pb2.PutAccountSnapshotRequest(agent_id=agent, account_id="acct", snapshot_version="s1"),
        authz_pb2.PutAccountSnapshotResponse,
    )
    racers = await NatsRacers.start(test_env, processes=4, per_process=16)
    try:
        for round_ in range(10):
            request, decision = await register_decision(
                rpc,
                agent,
                f"d-{round_}",
                capability="payments.transfer",
                risk=authz_pb2.RISK_LEVEL_R3,
                inputs={"round": round_},
            )
            counted = await racers.race(
                "Authorize",
                authz_pb2.AuthorizeRequest(
                    request=request, decision_id=decision.decision_id, decision_digest=decision.digest
                ),
            )
            assert counted == {"authorized": 1, "STALE_CAPABILITY_AUTHORIZATION": 63}, (round_, counted)
    finally:
        await racers.stop()


# ----- an executor killed between claim and settle ------------------------------------------------------

EXECUTOR = textwrap.dedent(
    """
    import asyncio, sys
    from parley.v1 import authz_pb2
    from parley_platform.bus import Bus
    from parley_platform.rpc import RpcClient

    async def main(url, namespace, agent, tool_call_id):
        bus = await Bus.connect(url, name="executor", namespace=namespace)
        reply = await RpcClient(bus).call("authz", "Decide", authz_pb2.DecideRequest(
            agent_id=agent, tool_call_id=tool_call_id, decision=authz_pb2.TOOL_DECISION_APPROVE,
            decided_by="executor"), authz_pb2.DecideResponse)
        print(authz_pb2.DecideResult.Name(reply.result), reply.tool_call.claim.token, flush=True)
        # "Running the tool": it never finishes; the test kills this process here.
        await asyncio.to_thread(sys.stdin.readline)

    asyncio.run(main(*sys.argv[1:5]))
    """
)


def cli(test_env: SessionEnv, replica: Replica, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PARLEY_")}
    env.update(
        PARLEY_NAMESPACE=test_env.namespace,
        PARLEY_OPERATOR_TOKEN=test_env.token,
        PARLEY_AUTHZ_ADDR=f"127.0.0.1:{replica.grpc_port}",
    )
    return subprocess.run([PARLEY, *args], env=env, capture_output=True, text=True, timeout=60, check=False)


async def test_a_killed_executor_leaves_a_stuck_claim_that_is_never_rerun(
    replicas: list[Replica], rpc: RpcClient, test_env: SessionEnv, agent: str
) -> None:
    await call(rpc, "PutPending", pending(agent, "crash-1"), authz_pb2.PutPendingResponse)
    executor = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        EXECUTOR,
        test_env.nats_url,
        test_env.namespace,
        agent,
        "crash-1",
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    try:
        assert executor.stdout is not None
        line = (await asyncio.wait_for(executor.stdout.readline(), 30)).decode().split()
        assert line[0] == "DECIDE_RESULT_CLAIMED"
        token = line[1]
    finally:
        executor.kill()
        await executor.wait()
    assert executor.returncode == -9

    # A sweep after the crash: a short-lived pending call expires, the claim is untouched.
    await call(
        rpc,
        "PutPending",
        pending(agent, "crash-probe", expires_at=ms(int(time.time() * 1000) + 200)),
        authz_pb2.PutPendingResponse,
    )

    async def probe_expired() -> bool:
        probe = await call(
            rpc,
            "GetToolCall",
            authz_pb2.GetToolCallRequest(agent_id=agent, tool_call_id="crash-probe"),
            authz_pb2.ToolCall,
        )
        return bool(probe.outcome == authz_pb2.TOOL_OUTCOME_EXPIRED)

    await eventually(probe_expired, timeout=10, what="a sweep to expire the probe")
    record = await call(
        rpc,
        "GetToolCall",
        authz_pb2.GetToolCallRequest(agent_id=agent, tool_call_id="crash-1"),
        authz_pb2.ToolCall,
    )
    assert record.status == authz_pb2.TOOL_CALL_STATUS_CLAIMED

    # Nobody else gets to run it: another executor only learns it is in flight.
    again = await call(rpc, "Decide", approve(agent, "crash-1", by="second"), authz_pb2.DecideResponse)
    assert again.result == authz_pb2.DECIDE_RESULT_IN_FLIGHT
    assert not again.tool_call.HasField("claim")

    # A stale token is refused and the record stays claimed.
    with pytest.raises(ParleyError) as stale:
        await call(
            rpc,
            "Settle",
            authz_pb2.SettleRequest(
                agent_id=agent,
                tool_call_id="crash-1",
                claim_token=str(uuid.uuid4()),
                outcome=authz_pb2.TOOL_OUTCOME_SUCCESS,
                settled_by="late",
            ),
            authz_pb2.ToolCall,
        )
    assert stale.value.code == "STALE_CLAIM_TOKEN"

    # The operator finds it, with its token, and settles it explicitly.
    stuck = await asyncio.to_thread(
        cli, test_env, replicas[1], "approvals", "stuck", "--agent", agent, "--older-than", "0"
    )
    assert stuck.returncode == 0, stuck.stderr
    assert "crash-1" in stuck.stdout
    assert token in stuck.stdout
    wrong = await asyncio.to_thread(
        cli,
        test_env,
        replicas[1],
        "approvals",
        "settle",
        "crash-1",
        "--agent",
        agent,
        "--claim-token",
        str(uuid.uuid4()),
        "--outcome",
        "indeterminate",
    )
    assert wrong.returncode == 1
    assert "claim token does not match" in wrong.stderr
    settled = await asyncio.to_thread(
        cli,
        test_env,
        replicas[1],
        "approvals",
        "settle",
        "crash-1",
        "--agent",
        agent,
        "--claim-token",
        token,
        "--outcome",
        "indeterminate",
        "--note",
        "no email in the provider's sent folder",
    )
    assert settled.returncode == 0, settled.stderr
    assert "settled as indeterminate" in settled.stdout
    record = await call(
        rpc,
        "GetToolCall",
        authz_pb2.GetToolCallRequest(agent_id=agent, tool_call_id="crash-1"),
        authz_pb2.ToolCall,
    )
    assert record.outcome == authz_pb2.TOOL_OUTCOME_INDETERMINATE
    assert record.settled_by.startswith("operator")


# ----- the operator's commands and the events an executor follows -----------------------------------------


async def test_approvals_commands_and_the_events_they_cause(
    replicas: list[Replica], rpc: RpcClient, bus: Bus, test_env: SessionEnv, agent: str
) -> None:
    for tool_call_id in ("cli-1", "cli-2"):
        await call(rpc, "PutPending", pending(agent, tool_call_id), authz_pb2.PutPendingResponse)
    listed = await asyncio.to_thread(cli, test_env, replicas[0], "approvals", "list", "--agent", agent)
    assert listed.returncode == 0, listed.stderr
    assert "cli-1" in listed.stdout
    assert "email bob the report" in listed.stdout
    as_json = await asyncio.to_thread(
        cli, test_env, replicas[0], "approvals", "list", "--agent", agent, "--json"
    )
    assert [item["tool_call_id"] for item in json.loads(as_json.stdout)["items"]] == ["cli-1", "cli-2"]

    approved = await asyncio.to_thread(
        cli, test_env, replicas[0], "approvals", "approve", "cli-1", "--agent", agent
    )
    assert approved.returncode == 0, approved.stderr
    assert "approved" in approved.stdout
    denied = await asyncio.to_thread(
        cli, test_env, replicas[1], "approvals", "deny", "cli-2", "--agent", agent, "--reason", "not today"
    )
    assert denied.returncode == 0, denied.stderr
    conflict = await asyncio.to_thread(
        cli, test_env, replicas[1], "approvals", "approve", "cli-2", "--agent", agent
    )
    assert conflict.returncode == 1
    assert "already decided" in conflict.stderr
    unknown = await asyncio.to_thread(
        cli, test_env, replicas[1], "approvals", "approve", "nope", "--agent", agent
    )
    assert unknown.returncode == 1
    assert "no tool call with that id" in unknown.stderr

    # What the runtime follows: the claim (with its token) on the event stream, then the outcome.
    sub = await bus.js.subscribe(
        bus.subjects.events(agent, "*"),
        ordered_consumer=True,
        config=ConsumerConfig(deliver_policy=DeliverPolicy.ALL),
    )
    try:
        events: dict[str, authz_pb2.ToolCallEvent] = {}
        while len(events) < 2:
            msg = await sub.next_msg(timeout=10)
            event = authz_pb2.ToolCallEvent.FromString(msg.data)
            events[f"{event.tool_call.tool_call_id}:{event.type}"] = event
        claimed = events["cli-1:TOOL_CALL_CLAIMED"]
        assert claimed.tool_call.claim.token
        assert events["cli-2:TOOL_CALL_SETTLED"].tool_call.reason == "not today"
        await call(
            rpc,
            "Settle",
            authz_pb2.SettleRequest(
                agent_id=agent,
                tool_call_id="cli-1",
                claim_token=claimed.tool_call.claim.token,
                outcome=authz_pb2.TOOL_OUTCOME_SUCCESS,
                result='{"sent": 1}',
                settled_by="runtime",
            ),
            authz_pb2.ToolCall,
        )
        msg = await sub.next_msg(timeout=10)
        settled = authz_pb2.ToolCallEvent.FromString(msg.data)
        assert (settled.type, settled.tool_call.tool_call_id) == ("TOOL_CALL_SETTLED", "cli-1")
        assert msg.headers
        assert msg.headers.get("Nats-Msg-Id") == f"authz:{agent}:cli-1:settled"
    finally:
        await sub.unsubscribe()
    empty = await asyncio.to_thread(cli, test_env, replicas[0], "approvals", "list", "--agent", agent)
    assert "(none)" in empty.stdout


async def test_leases_list_command(
    replicas: list[Replica], rpc: RpcClient, test_env: SessionEnv, agent: str
) -> None:
    await call(
        rpc,
        "AcquireLease",
        authz_pb2.AcquireLeaseRequest(
            agent_id=agent,
            resource=authz_pb2.LeaseResource(kind="pointer", id="display-0"),
            session_id="sess",
            owner="browser-worker",
            generation=3,
            lease_id="lease-cli",
            ttl_ms=60_000,
        ),
        authz_pb2.AcquireLeaseResponse,
    )
    listed = await asyncio.to_thread(cli, test_env, replicas[0], "leases", "list", "--agent", agent)
    assert listed.returncode == 0, listed.stderr
    assert "pointer:display-0" in listed.stdout
    assert "browser-worker" in listed.stdout
    missing = await asyncio.to_thread(
        cli, test_env, Replica(replicas[0].process, free_port(), 0), "leases", "list", "--agent", agent
    )
    assert missing.returncode == 1
    assert "not reachable" in missing.stderr


# ----- metrics --------------------------------------------------------------------------------


def scrape(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            samples[name] = float(value)
    return samples


async def test_metrics_show_pending_approvals_and_their_age(
    replicas: list[Replica], rpc: RpcClient, agent: str
) -> None:
    await call(
        rpc,
        "PutPending",
        pending(agent, "metric-1", proposed_at=ms(int(time.time() * 1000) - 120_000)),
        authz_pb2.PutPendingResponse,
    )
    port = replicas[1].metrics_port

    async def aged() -> dict[str, float] | None:
        samples = await asyncio.to_thread(scrape, port)
        if samples.get('parley_authz_pending_age_seconds{kind="tool_call"}', 0) >= 120:
            return samples
        return None

    samples = await eventually(aged, timeout=10, what="the gauges to show the old approval")
    assert samples['parley_authz_pending{kind="tool_call"}'] >= 1
    for name in (
        "parley_authz_leases_active",
        "parley_authz_claim_conflicts_total",
        "parley_authz_lease_conflicts_total",
        "parley_authz_time_to_decide_seconds_count",
    ):
        assert name in samples, name
    await call(rpc, "Decide", approve(agent, "metric-1"), authz_pb2.DecideResponse)

    async def decided() -> bool:
        total = 0.0
        for replica in replicas:
            got = await asyncio.to_thread(scrape, replica.metrics_port)
            total += got.get('parley_authz_decisions_total{kind="tool_call",outcome="claimed"}', 0)
        return total >= 1

    await eventually(decided, what="the decision to be counted")


async def test_a_replica_sweeps_expired_decisions_nobody_authorized(
    test_env: SessionEnv, rpc: RpcClient, agent: str, tmp_path: Path, replicas: list[Replica]
) -> None:
    """A replica of its own keeping expired decisions for no time at all: its sweeper deletes the
    one registered and left to expire, burns its confirmation and counts it."""
    replica = start_replica(
        test_env,
        tmp_path,
        PARLEY_AUTHZ_DECISION_RETENTION_SECONDS="0",
        PARLEY_AUTHZ_DECISION_SWEEP_SECONDS="0.2",
    )
    sweeper, metrics_port = replica.process, replica.metrics_port
    try:
        await sweeper.wait_ready()
        await call(
            rpc,
            "PutAccountSnapshot",
            authz_pb2.PutAccountSnapshotRequest(agent_id=agent, account_id="acct", snapshot_version="s1"),
            authz_pb2.PutAccountSnapshotResponse,
        )
        request, decision = await register_decision(
            rpc,
            agent,
            "d-left-to-expire",
            capability="mail.send",
            risk=authz_pb2.RISK_LEVEL_R2,
            inputs={"to": "bob"},
            confirmation_id="c-left-to-expire",
            ttl_ms=3000,
        )

        def state() -> tuple[int, str]:
            with psycopg.connect(test_env.database_url) as conn:
                row = conn.execute(
                    "SELECT (SELECT count(*) FROM authz.capability_decision WHERE agent_id = %(a)s),"
                    " (SELECT state FROM authz.capability_confirmation WHERE agent_id = %(a)s)",
                    {"a": uuid.UUID(agent)},
                ).fetchone()
            assert row is not None
            return int(row[0]), str(row[1])

        assert state() == (1, "pending")

        async def swept() -> bool:
            return await asyncio.to_thread(state) == (0, "burned")

        await eventually(swept, timeout=15, what="the sweeper to delete the expired decision")
        samples = await asyncio.to_thread(scrape, metrics_port)
        assert samples.get('parley_authz_burned_total{reason="unused"}', 0) >= 1
        with pytest.raises(ParleyError) as refusal:
            await call(
                rpc,
                "Authorize",
                authz_pb2.AuthorizeRequest(
                    request=request, decision_id=decision.decision_id, decision_digest=decision.digest
                ),
                authz_pb2.AuthorizeResponse,
            )
        assert refusal.value.code == "STALE_CAPABILITY_AUTHORIZATION"
    finally:
        sweeper.stop()
