"""The pairing service as real processes: three replicas raced by many NATS clients, the operator
gRPC API, the `parley pairing` commands, the metrics, real-time expiry, and the DM gate the runtime
runs before a turn (including failing closed when the service does not answer)."""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import struct
import subprocess
import sys
import urllib.request
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import psycopg
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from parley.v1 import common_pb2, pairing_pb2, pairing_pb2_grpc
from parley_clients.pairing import FULL_REPLY, Admission, DmPolicy, PairingGate
from parley_devinfra.infra import free_port
from parley_platform import frames
from parley_platform.bus import Bus
from parley_platform.errors import InvalidArgument, NotFound, ParleyError
from parley_platform.rpc import RpcClient
from parley_platform.testing import ServiceProcess, create_database, drop_database, eventually
from support import DEFAULT_AGENT_ID, SessionEnv, Suite

pytestmark = pytest.mark.e2e

P = pairing_pb2
PARLEY = str(Path(sys.executable).parent / "parley")
RACERS = 12


@dataclass
class Replica:
    process: ServiceProcess
    metrics_port: int


@dataclass
class Cluster:
    """Pairing replicas as real processes, in a NATS namespace of their own."""

    env: SessionEnv
    logs: Path
    namespace: str = field(default_factory=lambda: f"p{secrets.token_hex(4)}")
    replicas: list[Replica] = field(default_factory=list)

    def start_replica(self, database_url: str | None = None, **extra: str) -> Replica:
        grpc_port, metrics_port = free_port(), free_port()
        env = self.env.service_env(
            PARLEY_NAMESPACE=self.namespace,
            PARLEY_PAIRING_GRPC_PORT=str(grpc_port),
            PARLEY_PAIRING_METRICS_PORT=str(metrics_port),
            PARLEY_PAIRING_SWEEP_INTERVAL_SECONDS="0.2",
            **extra,
        )
        if database_url:
            env["PARLEY_DATABASE_URL"] = database_url
        process = ServiceProcess("parley_pairing", env, self.logs / f"pairing-{grpc_port}.log", grpc_port)
        replica = Replica(process.start(), metrics_port)
        self.replicas.append(replica)
        return replica

    async def start(self, count: int) -> Cluster:
        started = [self.start_replica() for _ in range(count)]
        for replica in started:
            await replica.process.wait_ready()
        return self

    async def stop(self) -> None:
        await asyncio.gather(*(asyncio.to_thread(r.process.stop) for r in self.replicas))

    async def connect(self, name: str = "tests") -> Bus:
        return await Bus.connect(self.env.nats_url, name=name, namespace=self.namespace)

    @property
    def grpc_address(self) -> str:
        return f"127.0.0.1:{self.replicas[0].process.grpc_port}"


@pytest.fixture(scope="module")
async def cluster(test_env: SessionEnv, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Cluster]:
    running = Cluster(test_env, tmp_path_factory.mktemp("pairing-logs"))
    try:
        yield await running.start(3)
    finally:
        await running.stop()


@pytest.fixture(scope="module")
async def client(cluster: Cluster) -> AsyncIterator[RpcClient]:
    bus = await cluster.connect()
    yield RpcClient(bus)
    await bus.close()


@pytest.fixture
async def clients(cluster: Cluster) -> AsyncIterator[list[RpcClient]]:
    """RACERS clients, each on its own NATS connection."""
    buses = await asyncio.gather(*(cluster.connect(f"racer-{i}") for i in range(RACERS)))
    yield [RpcClient(bus) for bus in buses]
    await asyncio.gather(*(bus.close() for bus in buses))


@pytest.fixture
def agent() -> str:
    return str(uuid.uuid4())


RESPONSES = {
    "UpsertRequest": P.UpsertRequestResponse,
    "ApproveCode": P.ApproveCodeResponse,
    "DenyCode": P.DenyCodeResponse,
    "IsAllowed": P.IsAllowedResponse,
    "AddToAllowlist": P.AddToAllowlistResponse,
    "RemoveFromAllowlist": P.RemoveFromAllowlistResponse,
    "ClaimPairingReply": P.ClaimPairingReplyResponse,
    "ListPendingRequestsPage": P.ListPendingRequestsPageResponse,
    "GetAllowlistPage": P.GetAllowlistPageResponse,
}


async def rpc(client: RpcClient, method: str, request: Any) -> Any:
    return await client.call("pairing", method, request, RESPONSES[method], timeout=15)


async def race(clients: list[RpcClient], method: str, request: Any) -> list[Any]:
    """The same call from every client at once; failures are returned, not raised."""
    return await asyncio.gather(*(rpc(c, method, request) for c in clients), return_exceptions=True)


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


async def metric(cluster: Cluster, name: str, **labels: str) -> float:
    """A sample summed over every replica."""
    key = (name, tuple(sorted(labels.items())))
    found = await asyncio.gather(*(asyncio.to_thread(scrape, r.metrics_port) for r in cluster.replicas))
    return sum(samples.get(key, 0.0) for samples in found)


def rows(database_url: str, sql: str, *params: Any) -> list[tuple[Any, ...]]:
    with psycopg.connect(database_url) as conn:
        return conn.execute(sql, params).fetchall()


# --- races against three replicas ------------------------------------------------------------------


async def test_twelve_new_senders_against_three_replicas_create_exactly_max_pending(
    cluster: Cluster, test_env: SessionEnv, agent: str
) -> None:
    channels = [f"race{i}" for i in range(3)]
    buses = await asyncio.gather(*(cluster.connect(f"sender-{i}") for i in range(RACERS * len(channels))))
    try:
        calls = [
            rpc(
                RpcClient(buses[n * RACERS + i]),
                "UpsertRequest",
                P.UpsertRequestRequest(agent_id=agent, channel=channel, sender_id=f"sender-{i}"),
            )
            for n, channel in enumerate(channels)
            for i in range(RACERS)
        ]
        results = await asyncio.gather(*calls)
    finally:
        await asyncio.gather(*(bus.close() for bus in buses))

    for n, channel in enumerate(channels):
        mine = results[n * RACERS : (n + 1) * RACERS]
        outcomes = sorted(P.UpsertOutcome.Name(r.outcome) for r in mine)
        assert outcomes == ["UPSERT_OUTCOME_CREATED"] * 3 + ["UPSERT_OUTCOME_FULL"] * 9, channel
        assert sum(r.created for r in mine) == 3
        assert all(not r.HasField("request") for r in mine if not r.created)
        stored = rows(
            test_env.database_url,
            "SELECT sender_id, code, slot FROM pairing.request WHERE agent_id = %s AND channel = %s",
            uuid.UUID(agent),
            channel,
        )
        assert sorted(r[0] for r in stored) == sorted(r.request.sender_id for r in mine if r.created)
        assert sorted(r[2] for r in stored) == [1, 2, 3]
        assert len({r[1] for r in stored}) == 3
    # Every replica took part in the race.
    served = await asyncio.gather(*(asyncio.to_thread(scrape, r.metrics_port) for r in cluster.replicas))
    key = ("parley_rpc_duration_seconds_count", (("method", "pairing.UpsertRequest"), ("outcome", "ok")))
    assert all(samples.get(key, 0) > 0 for samples in served), [s.get(key) for s in served]


async def test_a_chatty_new_sender_gets_one_request_and_one_reply(
    clients: list[RpcClient], agent: str
) -> None:
    upsert = P.UpsertRequestRequest(agent_id=agent, channel="discord", sender_id="chatty")
    results = await race(clients, "UpsertRequest", upsert)
    assert sum(r.created for r in results) == 1
    assert {r.outcome for r in results} == {P.UPSERT_OUTCOME_CREATED, P.UPSERT_OUTCOME_EXISTING}
    assert len({r.request.code for r in results}) == 1

    claims = await race(
        clients,
        "ClaimPairingReply",
        P.ClaimPairingReplyRequest(agent_id=agent, channel="discord", sender_id="chatty"),
    )
    assert sum(c.claimed for c in claims) == 1
    assert {c.code for c in claims} == {results[0].request.code}


async def test_a_code_is_approved_once(clients: list[RpcClient], client: RpcClient, agent: str) -> None:
    created = await rpc(
        client, "UpsertRequest", P.UpsertRequestRequest(agent_id=agent, channel="discord", sender_id="ann")
    )
    results = await race(
        clients,
        "ApproveCode",
        P.ApproveCodeRequest(agent_id=agent, channel="discord", code=created.request.code),
    )
    approved = [r for r in results if not isinstance(r, BaseException)]
    refused = [r for r in results if isinstance(r, BaseException)]
    assert len(approved) == 1
    assert approved[0].entry.sender_id == "ann"
    assert len(refused) == RACERS - 1
    assert all(isinstance(e, NotFound) and e.code == "CODE_NOT_FOUND" for e in refused), refused
    allowed = await rpc(
        client, "IsAllowed", P.IsAllowedRequest(agent_id=agent, channel="discord", sender_id="ann")
    )
    assert allowed.allowed


async def test_a_code_is_denied_once(clients: list[RpcClient], client: RpcClient, agent: str) -> None:
    created = await rpc(
        client, "UpsertRequest", P.UpsertRequestRequest(agent_id=agent, channel="discord", sender_id="bo")
    )
    results = await race(
        clients, "DenyCode", P.DenyCodeRequest(agent_id=agent, channel="discord", code=created.request.code)
    )
    assert sum(not isinstance(r, BaseException) for r in results) == 1
    assert all(isinstance(r, NotFound) for r in results if isinstance(r, BaseException))


async def test_allowlist_add_and_remove_each_have_one_winner(clients: list[RpcClient], agent: str) -> None:
    added = await race(
        clients, "AddToAllowlist", P.AddToAllowlistRequest(agent_id=agent, channel="discord", sender_id="cy")
    )
    assert sum(r.created for r in added) == 1
    assert len({r.entry.id for r in added}) == 1
    assert len({r.entry.created_at.ToNanoseconds() for r in added}) == 1
    removed = await race(
        clients,
        "RemoveFromAllowlist",
        P.RemoveFromAllowlistRequest(agent_id=agent, channel="discord", sender_id="cy"),
    )
    assert sum(r.existed for r in removed) == 1


# --- bad input -------------------------------------------------------------------------------------


async def test_bad_payloads_get_clear_errors_and_every_replica_keeps_serving(
    cluster: Cluster, agent: str
) -> None:
    bus = await cluster.connect()
    try:
        subject = bus.subjects.rpc("pairing", "UpsertRequest")
        for _ in range(6):
            garbage = frames.request(b"\xff\xfe not protobuf", deadline=None)
            reply = await bus.nc.request(subject, garbage, timeout=10)
            status, body = frames.parse_reply(reply.data)
            assert status == frames.ERROR
            error = ParleyError.from_proto(common_pb2.Error.FromString(body))
            assert isinstance(error, InvalidArgument)
            assert error.code == "INVALID_PAYLOAD"

        page = P.ListPendingRequestsPageRequest(agent_id=agent, channel="discord").SerializeToString()
        as_double = page + bytes([3 << 3 | 1]) + struct.pack("<d", 1.5)
        reply = await bus.nc.request(
            bus.subjects.rpc("pairing", "ListPendingRequestsPage"),
            frames.request(as_double, deadline=None),
            timeout=10,
        )
        status, body = frames.parse_reply(reply.data)
        assert status == frames.ERROR
        error = ParleyError.from_proto(common_pb2.Error.FromString(body))
        assert (error.code, error.message) == (
            "INVALID_PAGE",
            "limit must be an integer from 1 to 100, got a non-integer",
        )

        client = RpcClient(bus)
        for method, bad, mentions in [
            (
                "UpsertRequest",
                P.UpsertRequestRequest(
                    agent_id=agent, channel="discord", sender_id="x", metadata={"k": "\x00"}
                ),
                "metadata",
            ),
            (
                "UpsertRequest",
                P.UpsertRequestRequest(agent_id="nope", channel="discord", sender_id="x"),
                "agent_id",
            ),
            (
                "ApproveCode",
                P.ApproveCodeRequest(agent_id=agent, channel="discord", code="secret-ish 0O1I"),
                "code must",
            ),
        ]:
            with pytest.raises(InvalidArgument) as caught:
                await rpc(client, method, bad)
            assert mentions in caught.value.message
            assert "secret-ish" not in str(caught.value)
        results = await asyncio.gather(
            *(
                rpc(
                    client,
                    "IsAllowed",
                    P.IsAllowedRequest(agent_id=agent, channel="discord", sender_id=f"s{i}"),
                )
                for i in range(12)
            )
        )
        assert not any(r.allowed for r in results)
    finally:
        await bus.close()
    for replica in cluster.replicas:
        assert replica.process.process is not None
        assert replica.process.process.poll() is None, replica.process.log()


# --- the operator API and the CLI ------------------------------------------------------------------


async def test_operator_api_needs_the_token_and_names_bad_fields(
    cluster: Cluster, test_env: SessionEnv
) -> None:
    async with grpc.aio.insecure_channel(cluster.grpc_address) as channel:
        stub = pairing_pb2_grpc.PairingStub(channel)
        request = P.GetAllowlistPageRequest(agent_id=str(uuid.uuid4()), channel="discord")
        with pytest.raises(grpc.aio.AioRpcError) as anonymous:
            await stub.GetAllowlistPage(request, timeout=10)
        assert anonymous.value.code() == grpc.StatusCode.UNAUTHENTICATED

        auth = [("authorization", f"Bearer {test_env.token}")]
        for page, field_name in [
            ({"limit": 0}, "limit"),
            ({"limit": 101}, "limit"),
            ({"offset": -1}, "offset"),
        ]:
            with pytest.raises(grpc.aio.AioRpcError) as invalid:
                await stub.GetAllowlistPage(
                    P.GetAllowlistPageRequest(agent_id=request.agent_id, channel="discord", **page),
                    metadata=auth,
                    timeout=10,
                )
            assert invalid.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert f"{field_name} must be an integer" in (invalid.value.details() or "")
        empty = await stub.GetAllowlistPage(request, metadata=auth, timeout=10)
        assert (list(empty.items), empty.limit, empty.offset, empty.has_more) == ([], 50, 0, False)
        assert not empty.HasField("next_offset")

        health = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service="parley.v1.Pairing"), timeout=10
        )
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
        responses = reflection.ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")])
        )
        assert "parley.v1.Pairing" in [
            s.name async for r in responses for s in r.list_services_response.service
        ]


def cli_env(cluster: Cluster, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PARLEY_")}
    env.update(
        PARLEY_OPERATOR_TOKEN=cluster.env.token,
        PARLEY_PAIRING_ADDR=cluster.grpc_address,
        PARLEY_RUNTIME_ADDR=f"127.0.0.1:{free_port()}",
    )
    env.update(extra)
    return env


def parley(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([PARLEY, *args], env=env, capture_output=True, text=True, timeout=60, check=False)


async def test_the_pairing_commands(cluster: Cluster, client: RpcClient, agent: str) -> None:
    env = cli_env(cluster)
    codes = {}
    for sender in ("alice", "bob"):
        created = await rpc(
            client,
            "UpsertRequest",
            P.UpsertRequestRequest(agent_id=agent, channel="discord", sender_id=sender),
        )
        codes[sender] = created.request.code

    listed = await asyncio.to_thread(parley, ["pairing", "list", "discord", "--agent", agent], env)
    assert listed.returncode == 0, listed.stderr
    lines = listed.stdout.splitlines()
    assert lines[0].split()[:2] == ["CODE", "SENDER"]
    assert [line.split()[:2] for line in lines[1:]] == [[codes["bob"], "bob"], [codes["alice"], "alice"]]

    page = await asyncio.to_thread(
        parley, ["pairing", "list", "discord", "--agent", agent, "--limit", "1", "--json"], env
    )
    assert page.returncode == 0, page.stderr
    document = json.loads(page.stdout)
    assert (document["limit"], document["offset"], document["has_more"], document["next_offset"]) == (
        1,
        0,
        True,
        1,
    )
    assert [item["code"] for item in document["items"]] == [codes["bob"]]

    # The code as a person types it: lower case, split by a space, even across arguments.
    code = codes["alice"].lower()
    approved = await asyncio.to_thread(
        parley, ["pairing", "approve", "discord", code[:4], code[4:], "--agent", agent], env
    )
    assert approved.returncode == 0, approved.stderr
    assert "alice may now talk" in approved.stdout
    again = await asyncio.to_thread(parley, ["pairing", "approve", "discord", code, "--agent", agent], env)
    assert again.returncode == 1
    assert "no pending request with that code" in again.stderr
    assert codes["alice"] not in again.stderr
    assert code not in again.stderr

    denied = await asyncio.to_thread(
        parley, ["pairing", "deny", "discord", f" {codes['bob']} ", "--agent", agent], env
    )
    assert denied.returncode == 0, denied.stderr
    allowed = await asyncio.to_thread(
        parley, ["pairing", "allow", "discord", "carol", "--agent", agent, "--by", "ops"], env
    )
    assert allowed.returncode == 0, allowed.stderr
    assert "carol is added to the allowlist" in allowed.stdout

    entries = await asyncio.to_thread(
        parley, ["pairing", "allowlist", "discord", "--agent", agent, "--json"], env
    )
    assert entries.returncode == 0, entries.stderr
    document = json.loads(entries.stdout)
    assert [(e["sender_id"], e["added_by"]) for e in document["items"]] == [
        ("carol", "ops"),
        ("alice", "operator"),
    ]
    assert document["next_offset"] is None

    revoked = await asyncio.to_thread(
        parley, ["pairing", "revoke", "discord", "carol", "--agent", agent], env
    )
    assert revoked.returncode == 0, revoked.stderr
    assert "carol is removed" in revoked.stdout
    assert not (
        await rpc(
            client, "IsAllowed", P.IsAllowedRequest(agent_id=agent, channel="discord", sender_id="carol")
        )
    ).allowed
    assert (
        await rpc(
            client, "IsAllowed", P.IsAllowedRequest(agent_id=agent, channel="discord", sender_id="alice")
        )
    ).allowed

    bad = await asyncio.to_thread(
        parley, ["pairing", "list", "discord", "--agent", agent, "--limit", "1.5"], env
    )
    assert bad.returncode == 1
    assert "limit must be an integer from 1 to 100, got '1.5'" in bad.stderr


async def test_the_commands_report_a_pairing_service_that_is_not_running(
    cluster: Cluster, agent: str
) -> None:
    env = cli_env(cluster, PARLEY_PAIRING_ADDR=f"127.0.0.1:{free_port()}")
    result = await asyncio.to_thread(parley, ["pairing", "list", "discord", "--agent", agent], env)
    assert result.returncode == 1
    assert "the pairing is not reachable" in result.stderr
    assert "PARLEY_PAIRING_ADDR" in result.stderr


async def test_the_commands_resolve_an_agent_name_through_the_runtime(
    cluster: Cluster, client: RpcClient, suite: Suite
) -> None:
    channel = f"named{secrets.token_hex(3)}"
    created = await rpc(
        client,
        "UpsertRequest",
        P.UpsertRequestRequest(agent_id=DEFAULT_AGENT_ID, channel=channel, sender_id="dee"),
    )
    env = cli_env(cluster, PARLEY_RUNTIME_ADDR=f"127.0.0.1:{suite.runtime.grpc_port}")
    approved = await asyncio.to_thread(parley, ["pairing", "approve", channel, created.request.code], env)
    assert approved.returncode == 0, approved.stderr
    allowed = await rpc(
        client, "IsAllowed", P.IsAllowedRequest(agent_id=DEFAULT_AGENT_ID, channel=channel, sender_id="dee")
    )
    assert allowed.allowed
    unknown = await asyncio.to_thread(parley, ["pairing", "list", channel, "--agent", "nobody"], env)
    assert unknown.returncode == 1
    assert "no agent named 'nobody'" in unknown.stderr


# --- metrics and expiry ----------------------------------------------------------------------------


async def test_the_metrics_of_the_spec(cluster: Cluster, client: RpcClient, agent: str) -> None:
    channel = f"m{secrets.token_hex(4)}"
    before_approvals = await metric(cluster, "parley_pairing_approvals_total")
    before_denied = await metric(cluster, "parley_pairing_denied_messages_total")
    created = []
    for i in range(4):
        reply = await rpc(
            client,
            "UpsertRequest",
            P.UpsertRequestRequest(agent_id=agent, channel=channel, sender_id=f"s{i}"),
        )
        created.append(reply)
    await rpc(
        client, "UpsertRequest", P.UpsertRequestRequest(agent_id=agent, channel=channel, sender_id="s0")
    )
    for i in range(2):
        await rpc(client, "IsAllowed", P.IsAllowedRequest(agent_id=agent, channel=channel, sender_id=f"s{i}"))
    await rpc(
        client,
        "ApproveCode",
        P.ApproveCodeRequest(agent_id=agent, channel=channel, code=created[0].request.code),
    )

    async def counted() -> bool:
        return (
            await metric(cluster, "parley_pairing_requests_total", channel=channel, outcome="created") == 3
            and await metric(cluster, "parley_pairing_requests_total", channel=channel, outcome="full") == 1
            and await metric(cluster, "parley_pairing_requests_total", channel=channel, outcome="existing")
            == 1
            and await metric(cluster, "parley_pairing_approvals_total") == before_approvals + 1
            and await metric(cluster, "parley_pairing_denied_messages_total") == before_denied + 2
        )

    await eventually(counted, what="pairing counters")

    async def gauge_reads(value: float) -> bool:
        # Every replica refreshes the gauge from the database, so each one reports the channel's count.
        found = await asyncio.gather(*(asyncio.to_thread(scrape, r.metrics_port) for r in cluster.replicas))
        key = ("parley_pairing_pending", (("channel", channel),))
        return all(samples.get(key) == value for samples in found)

    await eventually(lambda: gauge_reads(2), what="pending gauge at 2")
    for reply in created[1:3]:
        await rpc(
            client, "DenyCode", P.DenyCodeRequest(agent_id=agent, channel=channel, code=reply.request.code)
        )
    await eventually(lambda: gauge_reads(0), what="pending gauge back to 0")


@pytest.fixture
def short_lived_database(test_env: SessionEnv) -> Iterator[str]:
    # Its own database: a replica with a 1 s TTL sweeps every request older than that.
    name = f"parley_pairing_ttl_{secrets.token_hex(4)}"
    url = create_database(test_env.server_database_url, name)
    yield url
    drop_database(test_env.server_database_url, name)


async def test_requests_expire_in_real_time_and_are_swept(
    test_env: SessionEnv, short_lived_database: str, tmp_path: Path
) -> None:
    ttl = Cluster(test_env, tmp_path)
    replica = ttl.start_replica(short_lived_database, PARLEY_PAIRING_REQUEST_TTL_SECONDS="1")
    bus = await ttl.connect()
    try:
        await replica.process.wait_ready()
        client = RpcClient(bus)
        agent = str(uuid.uuid4())
        created = await rpc(
            client, "UpsertRequest", P.UpsertRequestRequest(agent_id=agent, channel="discord", sender_id="x")
        )
        assert created.created

        async def listed() -> int:
            page = await rpc(
                client,
                "ListPendingRequestsPage",
                P.ListPendingRequestsPageRequest(agent_id=agent, channel="discord"),
            )
            return len(page.items)

        async def gone() -> bool:
            return await listed() == 0

        await eventually(gone, timeout=15, what="the request to expire")
        with pytest.raises(NotFound):
            await rpc(
                client,
                "ApproveCode",
                P.ApproveCodeRequest(agent_id=agent, channel="discord", code=created.request.code),
            )

        async def swept() -> bool:
            return not rows(short_lived_database, "SELECT 1 FROM pairing.request")

        await eventually(swept, timeout=15, what="the sweeper to delete the expired row")
        again = await rpc(
            client, "UpsertRequest", P.UpsertRequestRequest(agent_id=agent, channel="discord", sender_id="x")
        )
        assert again.created
        assert again.request.code != created.request.code
    finally:
        await bus.close()
        await ttl.stop()


# --- the DM gate -----------------------------------------------------------------------------------


async def test_the_gate_pairs_an_unknown_sender_once_then_serves_them_after_approval(
    cluster: Cluster, agent: str
) -> None:
    buses = await asyncio.gather(*(cluster.connect(f"runtime-{i}") for i in range(8)))
    try:
        gates = [PairingGate(RpcClient(bus)) for bus in buses]

        async def admit(gate: PairingGate) -> Admission:
            return await gate.admit(
                agent_id=agent, channel="discord", sender_id="newbie", policy=DmPolicy.PAIRING
            )

        # Eight messages of one sender, handled at once by eight runtime replicas.
        first = await asyncio.gather(*(admit(g) for g in gates))
        assert not any(a.serve for a in first)
        told = [a for a in first if a.reply]
        assert len(told) == 1, first
        code = told[0].code
        assert code
        assert told[0].reason == "pairing_code"
        assert f"parley pairing approve discord {code}" in (told[0].reply or "")
        assert {a.reason for a in first if not a.reply} == {"pairing_told"}
        for _ in range(3):
            assert (await admit(gates[0])).reply is None

        approved = await asyncio.to_thread(
            parley, ["pairing", "approve", "discord", code.lower(), "--agent", agent], cli_env(cluster)
        )
        assert approved.returncode == 0, approved.stderr
        after = await asyncio.gather(*(admit(g) for g in gates))
        assert all(a.serve and a.reason == "allowed" and a.reply is None for a in after)
    finally:
        await asyncio.gather(*(bus.close() for bus in buses))


async def test_the_gate_policies(cluster: Cluster, client: RpcClient, agent: str) -> None:
    gate = PairingGate(client)

    async def admit(policy: DmPolicy, sender: str = "guest") -> Admission:
        return await gate.admit(agent_id=agent, channel="discord", sender_id=sender, policy=policy)

    assert await admit(DmPolicy.OPEN) == Admission(True, "open")
    assert await admit(DmPolicy.CLOSED) == Admission(False, "closed")
    assert await admit(DmPolicy.ALLOWLIST) == Admission(False, "not_allowed")
    pending = await rpc(
        client, "ListPendingRequestsPage", P.ListPendingRequestsPageRequest(agent_id=agent, channel="discord")
    )
    assert list(pending.items) == [], "the allowlist policy gives no codes"
    await rpc(
        client,
        "AddToAllowlist",
        P.AddToAllowlistRequest(agent_id=agent, channel="discord", sender_id="guest"),
    )
    assert await admit(DmPolicy.ALLOWLIST) == Admission(True, "allowed")
    assert await admit(DmPolicy.PAIRING) == Admission(True, "allowed")
    assert await admit(DmPolicy.CLOSED) == Admission(False, "closed")

    # A connector source that is not a valid channel name: refused, silently, and not served.
    refused = await gate.admit(
        agent_id=agent, channel="no spaces please", sender_id="x", policy=DmPolicy.PAIRING
    )
    assert refused == Admission(False, "rejected")

    # A full channel: the fourth new sender is told so once, then nothing more.
    for i in range(3):
        assert (await admit(DmPolicy.PAIRING, f"n{i}")).reason == "pairing_code"
    assert await admit(DmPolicy.PAIRING, "n3") == Admission(False, "pairing_full", FULL_REPLY)
    assert await admit(DmPolicy.PAIRING, "n3") == Admission(False, "pairing_told")


async def test_the_gate_fails_closed_when_pairing_does_not_answer(
    test_env: SessionEnv, tmp_path: Path, agent: str
) -> None:
    alone = Cluster(test_env, tmp_path)
    replica = alone.start_replica()
    bus = await alone.connect()
    try:
        await replica.process.wait_ready()
        gate = PairingGate(RpcClient(bus), timeout=1.0)
        await rpc(
            RpcClient(bus),
            "AddToAllowlist",
            P.AddToAllowlistRequest(agent_id=agent, channel="discord", sender_id="ok"),
        )
        assert (
            await gate.admit(agent_id=agent, channel="discord", sender_id="ok", policy=DmPolicy.PAIRING)
        ).serve

        replica.process.kill()
        for policy in (DmPolicy.PAIRING, DmPolicy.ALLOWLIST):
            for sender in ("ok", "stranger"):
                # Closed, and the caller told to wait for pairing (its consumer holds the message).
                with pytest.raises(ParleyError) as failed:
                    await gate.admit(agent_id=agent, channel="discord", sender_id=sender, policy=policy)
                assert failed.value.code == "DEPENDENCY_UNAVAILABLE"
                assert failed.value.dependency == "pairing"
        # Open needs no answer from anyone.
        assert (
            await gate.admit(agent_id=agent, channel="discord", sender_id="x", policy=DmPolicy.OPEN)
        ).serve
    finally:
        await bus.close()
        await alone.stop()
