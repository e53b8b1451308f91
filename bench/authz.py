"""Decides/s and authorizes/s through the authz service, against the raw statement they wrap.

The authz service runs as a real process. Clients call Decide (approve a
pending tool call: pending -> claimed) and Authorize (consume a registered
capability decision) over NATS request/reply and over gRPC, with 1 client and
with 16 concurrent clients (each its own NATS connection or gRPC channel).
Every record is decided or consumed once, so each call does the real work,
never an idempotent replay.

The floor is measured in the same run: the raw single ``UPDATE … WHERE state =
'pending' RETURNING`` on one connection and on 16 connections, plus a raw NATS
request/reply. These machines are shared and noisy, so each measure alternates
chunks of the floor and of the service call at the same concurrency, and its
ratio compares totals taken side by side. Each also reports the CPU time every
process spent per call (authz, PostgreSQL's backends, nats-server, the client),
which noise moves far less than a rate.

Usage: python bench/authz.py [--sequential 900] [--concurrent 3600] [--clients 16] [--replicas 1]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import secrets
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
import psycopg
from _common import (
    BenchEnv,
    Groups,
    Series,
    bench_env,
    cpu_ms_per_op,
    cpu_snapshot,
    pids_matching,
    report,
    service_nats,
)

from parley.v1 import authz_pb2, authz_pb2_grpc
from parley_devinfra.infra import free_port
from parley_platform import canonical
from parley_platform.bus import Bus
from parley_platform.rpc import RpcClient
from parley_platform.testing import ServiceProcess

Op = Callable[[int, int], Awaitable[Any]]
CHUNKS = 3


async def timed(name: str, n: int, clients: int, op: Op) -> Series:
    """Run ``op(i, client)`` for i in 0..n-1 with ``clients`` workers; latency per call."""
    latencies: list[float] = []
    next_index = iter(range(n))

    async def worker(client: int) -> None:
        for i in next_index:
            started = time.perf_counter()
            await op(i, client)
            latencies.append(time.perf_counter() - started)

    started = time.perf_counter()
    await asyncio.gather(*(worker(c) for c in range(clients)))
    return Series(name, latencies, time.perf_counter() - started)


class SqlFloor:
    """The raw statement a claim is: flip one pending row, returning it; every row once."""

    def __init__(self, conns: list[psycopg.AsyncConnection[Any]], table: str) -> None:
        self.conns = conns
        self.table = table
        self.next_row = 0

    @classmethod
    async def create(cls, env: BenchEnv, connections: int, rows: int) -> SqlFloor:
        conns = [
            await psycopg.AsyncConnection.connect(env.database_url, autocommit=True)
            for _ in range(connections)
        ]
        table = f"bench_floor_{secrets.token_hex(3)}"
        await conns[0].execute(f"CREATE TABLE {table} (id int PRIMARY KEY, state text NOT NULL)")
        await conns[0].execute(
            f"INSERT INTO {table} SELECT g, 'pending' FROM generate_series(0, {rows - 1}) g"
        )
        return cls(conns, table)

    async def chunk(self, n: int, clients: int) -> Series:
        first = self.next_row
        self.next_row += n
        statement = (
            f"UPDATE {self.table} SET state = 'claimed' WHERE id = %s AND state = 'pending' RETURNING id"
        )

        async def flip(i: int, client: int) -> None:
            cur = await self.conns[client].execute(statement, (first + i,), prepare=True)
            assert await cur.fetchone() is not None

        return await timed("", n, clients, flip)

    async def close(self) -> None:
        await self.conns[0].execute(f"DROP TABLE {self.table}")
        for conn in self.conns:
            await conn.close()


async def nats_floor(env: BenchEnv, buses: list[Bus], n: int, clients: int) -> Series:
    subject = f"{env.namespace}.floor.echo"

    async def echo(msg: Any) -> None:
        await msg.respond(msg.data)

    sub = await buses[0].nc.subscribe(subject, cb=echo)
    await buses[0].nc.flush()

    async def request(i: int, client: int) -> None:
        await buses[client].nc.request(subject, b"x" * 200, timeout=10)

    try:
        return await timed(f"floor: NATS request/reply, {clients} client(s)", n, clients, request)
    finally:
        await sub.unsubscribe()


class Workload:
    """Pending tool calls and registered decisions, each used by exactly one timed call."""

    def __init__(self, env: BenchEnv, agent: str, rpc: RpcClient) -> None:
        self.env = env
        self.agent = agent
        self.rpc = rpc
        self.calls = 0
        self.registered = 0

    async def pending(self, n: int) -> list[str]:
        """Insert n pending tool calls (untimed, directly) and return their ids."""
        first = self.calls
        self.calls += n
        async with await psycopg.AsyncConnection.connect(self.env.database_url, autocommit=True) as conn:
            await conn.execute(
                "INSERT INTO authz.tool_call (agent_id, id, conversation_id, message_id, call_index, tool,"
                " args_digest, proposed_at, on_expiry)"
                " SELECT %s, 'call-' || g, 'room', 'msg-' || g, 0, 'SEND_EMAIL', repeat('0', 64),"
                " now(), 'deny'"
                " FROM generate_series(%s::int, %s::int) g",
                (uuid.UUID(self.agent), first, self.calls - 1),
            )
        return [f"call-{i}" for i in range(first, self.calls)]

    async def decisions(self, n: int) -> list[authz_pb2.AuthorizeRequest]:
        """Register n allowed decisions through the service (untimed); the Authorize request of each."""
        now = int(time.time() * 1000)
        first = self.registered
        self.registered += n
        registrations: list[authz_pb2.RegisterDecisionRequest] = []
        for i in range(first, self.registered):
            request = authz_pb2.CapabilityRequest(
                version=1,
                agent_id=self.agent,
                account_id="acct",
                snapshot_version="v1",
                capability="mail.send",
                operation="create",
                catalog_risk=authz_pb2.RISK_LEVEL_R2,
                risk=authz_pb2.RISK_LEVEL_R2,
                input_digest=canonical.tool_arguments_digest({"i": i}),
            )
            request.bound_at.FromMilliseconds(now - 100)
            decision = authz_pb2.PolicyDecision(
                version=1,
                decision_id=f"d-{i}",
                request_digest=canonical.request_digest(request),
                outcome=authz_pb2.POLICY_OUTCOME_ALLOWED,
            )
            decision.issued_at.FromMilliseconds(now - 50)
            decision.expires_at.FromMilliseconds(now + 3_600_000)
            decision.digest = canonical.decision_digest(decision)
            registrations.append(authz_pb2.RegisterDecisionRequest(request=request, decision=decision))

        async def register(i: int, client: int) -> None:
            await self.rpc.call(
                "authz", "RegisterDecision", registrations[i], authz_pb2.RegisterDecisionResponse, timeout=30
            )

        await timed("register", n, 32, register)
        return [
            authz_pb2.AuthorizeRequest(
                request=r.request, decision_id=r.decision.decision_id, decision_digest=r.decision.digest
            )
            for r in registrations
        ]


def service_process(env: BenchEnv, token: str, clients: int, index: int) -> ServiceProcess:
    grpc_port = free_port()
    return ServiceProcess(
        "parley_authz",
        {
            **service_nats(env),
            "PARLEY_DATABASE_URL": env.database_url,
            "PARLEY_NAMESPACE": env.namespace,
            "PARLEY_OPERATOR_TOKEN": token,
            "PARLEY_LOG_LEVEL": "WARNING",
            "PARLEY_ENVIRONMENT": "test",
            "PARLEY_AUTHZ_GRPC_PORT": str(grpc_port),
            "PARLEY_AUTHZ_METRICS_PORT": str(free_port()),
            "PARLEY_DB_POOL_MIN": str(clients),
            "PARLEY_DB_POOL_MAX": str(clients),
        },
        env.logs / f"authz-{index}.log",
        grpc_port,
    )


async def main(args: argparse.Namespace) -> None:
    clients = args.clients
    widths = ((1, args.sequential), (clients, args.concurrent))
    with bench_env() as env:
        token = secrets.token_hex(16)
        services = [service_process(env, token, clients, i).start() for i in range(args.replicas)]
        buses = [
            await Bus.connect(env.nats_url, name=f"bench-{c}", namespace=env.namespace)
            for c in range(clients)
        ]
        # Client c talks to replica c mod replicas over gRPC; NATS spreads requests over the queue group.
        channels = [
            grpc.aio.insecure_channel(f"127.0.0.1:{services[c % len(services)].grpc_port}")
            for c in range(clients)
        ]
        stubs = [authz_pb2_grpc.AuthzStub(channel) for channel in channels]
        metadata = [("authorization", f"Bearer {token}")]
        rpcs = [RpcClient(bus) for bus in buses]
        agent = str(uuid.uuid4())
        work = Workload(env, agent, rpcs[0])
        floor = await SqlFloor.create(env, clients, rows=8 * (args.sequential + args.concurrent) + 1000)
        results: dict[str, Series] = {}
        floors: dict[str, Series] = {}
        cpu: dict[str, dict[str, float]] = {}  # CPU ms per call, by process group
        cpu_floor: dict[str, dict[str, float]] = {}
        try:
            for service in services:
                await service.wait_ready()
            await rpcs[0].call(
                "authz",
                "PutAccountSnapshot",
                authz_pb2.PutAccountSnapshotRequest(agent_id=agent, account_id="acct", snapshot_version="v1"),
                authz_pb2.PutAccountSnapshotResponse,
            )

            async def decides(transport: str, n: int, width: int) -> Callable[[], Awaitable[Series]]:
                """The timed run of n Decide calls, its records made first (untimed)."""
                ids = await work.pending(n)

                def request(i: int) -> authz_pb2.DecideRequest:
                    return authz_pb2.DecideRequest(
                        agent_id=agent,
                        tool_call_id=ids[i],
                        decision=authz_pb2.TOOL_DECISION_APPROVE,
                        decided_by="bench",
                    )

                async def over_nats(i: int, client: int) -> None:
                    reply = await rpcs[client].call(
                        "authz", "Decide", request(i), authz_pb2.DecideResponse, timeout=30
                    )
                    assert reply.result == authz_pb2.DECIDE_RESULT_CLAIMED

                async def over_grpc(i: int, client: int) -> None:
                    reply = await stubs[client].Decide(request(i), metadata=metadata, timeout=30)
                    assert reply.result == authz_pb2.DECIDE_RESULT_CLAIMED

                return lambda: timed("", n, width, over_nats if transport == "nats" else over_grpc)

            async def authorizes(transport: str, n: int, width: int) -> Callable[[], Awaitable[Series]]:
                """The timed run of n Authorize calls, their decisions registered first (untimed)."""
                requests = await work.decisions(n)

                async def over_nats(i: int, client: int) -> None:
                    await rpcs[client].call(
                        "authz", "Authorize", requests[i], authz_pb2.AuthorizeResponse, timeout=30
                    )

                async def over_grpc(i: int, client: int) -> None:
                    await stubs[client].Authorize(requests[i], metadata=metadata, timeout=30)

                return lambda: timed("", n, width, over_nats if transport == "nats" else over_grpc)

            # Warm-up: connections, prepared statements, the service's pools.
            for transport in ("nats", "grpc"):
                await (await decides(transport, 200, clients))()
                await (await authorizes(transport, 200, clients))()
            await floor.chunk(200, clients)

            groups: Groups = {
                "authz": lambda: [s.pid for s in services],
                "postgres": lambda: pids_matching("postgres: ", env.database_url.rsplit("/", 1)[-1]),
                "nats": lambda: pids_matching("nats-server", str(env.logs.parent)),
                "client": lambda: [os.getpid()],
            }
            operations = {"decide": decides, "authorize": authorizes}
            for name, run in operations.items():
                for transport in ("nats", "grpc"):
                    for width, n in widths:
                        mine: list[Series] = []
                        raw: list[Series] = []
                        spent: dict[str, float] = {}
                        spent_raw: dict[str, float] = {}
                        for _ in range(CHUNKS):
                            ready = await run(transport, n // CHUNKS, width)
                            before = cpu_snapshot(groups)
                            raw.append(await floor.chunk(n // CHUNKS, width))
                            between = cpu_snapshot(groups)
                            mine.append(await ready())
                            after = cpu_snapshot(groups)
                            for k, v in cpu_ms_per_op(before, between, n).items():
                                spent_raw[k] = spent_raw.get(k, 0.0) + v
                            for k, v in cpu_ms_per_op(between, after, n).items():
                                spent[k] = spent.get(k, 0.0) + v
                        key = f"{name}:{transport}:{width}"
                        label = f"{name.title()} over {transport}, {width} client(s)"
                        results[key] = Series.merged(label, mine)
                        floor_label = f"  floor beside it: UPDATE … RETURNING, {width} conn"
                        floors[key] = Series.merged(floor_label, raw)
                        cpu[key] = {k: round(v, 3) for k, v in spent.items()}
                        cpu_floor[key] = {k: round(v, 3) for k, v in spent_raw.items()}
            nats = {width: await nats_floor(env, buses, n, width) for width, n in widths}
        finally:
            await floor.close()
            for channel in channels:
                await channel.close()
            for bus in buses:
                await bus.close()
            for service in services:
                service.stop()

    summary: dict[str, object] = {
        "benchmark": "authz",
        "clients": clients,
        "replicas": args.replicas,
        "series": {key: series.figures() for key, series in results.items()},
        "floors": {key: series.figures() for key, series in floors.items()},
        "cpu_ms_per_call": cpu,
        "floor_cpu_ms_per_statement": cpu_floor,
    }
    for key, series in results.items():
        name = key.replace(":", "_")
        summary[f"{name}_per_s"] = round(series.rate, 1)
        summary[f"{name}_ratio_to_sql"] = round(series.rate / floors[key].rate, 3)
    for width, series in nats.items():
        summary[f"floor_nats_{width}_per_s"] = round(series.rate, 1)
    rows = [row for key in results for row in (results[key], floors[key])] + list(nats.values())
    for key in results:
        print(
            f"CPU ms per call, {key}: "
            + ", ".join(f"{k.removesuffix('_cpu_ms')} {v:.3f}" for k, v in cpu[key].items())
            + "; the floor's per statement: "
            + ", ".join(f"{k.removesuffix('_cpu_ms')} {v:.3f}" for k, v in cpu_floor[key].items())
        )
    report(
        f"authz: Decide and Authorize vs the raw UPDATE … RETURNING"
        f" ({clients} clients, {args.replicas} replica(s))",
        rows,
        summary,
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sequential", type=int, default=900)
    parser.add_argument("--concurrent", type=int, default=3600)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--replicas", type=int, default=1, help="authz service processes")
    asyncio.run(main(parser.parse_args()))
