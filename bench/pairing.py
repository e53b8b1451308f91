"""Pairing pages on 100,000 rows and upserts with 16 concurrent clients, against their own floor.

The pairing service runs as real processes. One agent's channel holds 100,000
live pending requests and 100,000 allowlist entries (the worst case for its
pages; the table also holds other agents' rows, a fifth as many; ``--rows`` changes the size). Measured:

- page latency p50/p99, first, middle and last page (limit 50), through NATS
  request/reply and through the operator gRPC API, and the same page SELECT
  run directly on the database (the raw SQL floor);
- UpsertRequest with 16 concurrent clients (each its own NATS connection), new
  senders in channels with free slots (the heaviest path: an insert that takes a
  slot), against the same upsert statement run directly on 16 connections, and
  the plain one-statement ``UPDATE … RETURNING`` floor of ENV.md.

Usage: python bench/pairing.py [--pages 300] [--upserts 4000] [--clients 16] [--replicas 2] [--rows 100000]
"""

from __future__ import annotations

import argparse
import asyncio
import secrets
import time
import uuid
from collections.abc import Awaitable, Callable

import grpc
import psycopg
from _common import BenchEnv, Series, bench_env, report, service_nats
from psycopg.types.json import Jsonb

from parley.v1 import pairing_pb2, pairing_pb2_grpc
from parley_devinfra.infra import free_port
from parley_pairing.domain import new_code
from parley_pairing.store import MIGRATIONS_DIR, SCHEMA, Q
from parley_platform.bus import Bus
from parley_platform.postgres import migrate
from parley_platform.rpc import RpcClient
from parley_platform.testing import ServiceProcess

ROWS = 100_000
TTL = 3600.0
LIMIT = 50
Op = Callable[[int, int], Awaitable[object]]


async def timed(name: str, n: int, in_flight: int, op: Op) -> Series:
    """Run ``op(i, slot)`` n times with at most ``in_flight`` at once; latencies per call."""
    latencies: list[float] = []
    counter = iter(range(n))

    async def worker(slot: int) -> None:
        for i in counter:
            started = time.perf_counter()
            await op(i, slot)
            latencies.append(time.perf_counter() - started)

    started = time.perf_counter()
    await asyncio.gather(*(worker(s) for s in range(in_flight)))
    return Series(name, latencies, time.perf_counter() - started)


async def seed(url: str, agent: uuid.UUID, rows: int) -> None:
    await migrate(url, SCHEMA, MIGRATIONS_DIR)
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        total = rows + rows // 5  # other agents' rows too
        await conn.execute(
            "INSERT INTO pairing.request (agent_id, channel, sender_id, code, slot, created_at)"
            " SELECT CASE WHEN g <= %(rows)s THEN %(agent)s ELSE gen_random_uuid() END, 'discord',"
            "        's' || g, translate(lpad(to_hex(g), 8, '0'), '01abcdef', 'ABCDEFGH'), g,"
            "        now() - g * interval '1 ms'"
            "   FROM generate_series(1, %(total)s) g",
            {"agent": agent, "rows": rows, "total": total},
        )
        await conn.execute(
            "INSERT INTO pairing.allowlist (agent_id, channel, sender_id, added_by, created_at)"
            " SELECT CASE WHEN g <= %(rows)s THEN %(agent)s ELSE gen_random_uuid() END, 'discord',"
            "        's' || g, 'seed', now() - g * interval '1 ms'"
            "   FROM generate_series(1, %(total)s) g",
            {"agent": agent, "rows": rows, "total": total},
        )
        await conn.execute("VACUUM ANALYZE pairing.request")
        await conn.execute("VACUUM ANALYZE pairing.allowlist")


def start_replicas(env: BenchEnv, token: str, count: int) -> list[ServiceProcess]:
    replicas = []
    for _ in range(count):
        port = free_port()
        replicas.append(
            ServiceProcess(
                "parley_pairing",
                {
                    **service_nats(env),
                    "PARLEY_DATABASE_URL": env.database_url,
                    "PARLEY_NAMESPACE": env.namespace,
                    "PARLEY_OPERATOR_TOKEN": token,
                    "PARLEY_PAIRING_GRPC_PORT": str(port),
                    "PARLEY_PAIRING_METRICS_PORT": str(free_port()),
                    "PARLEY_LOG_LEVEL": "WARNING",
                    "PARLEY_ENVIRONMENT": "test",
                    "PARLEY_DB_POOL_MAX": "16",
                },
                env.logs / f"pairing-{port}.log",
                port,
            ).start()
        )
    return replicas


PAGE_NAMES = ("first", "middle", "last")


def page_offsets(rows: int) -> dict[str, int]:
    return {"first": 0, "middle": rows // 2, "last": rows - LIMIT}


LISTS = {
    "pending": ("ListPendingRequestsPage", pairing_pb2.ListPendingRequestsPageRequest, "pending_page"),
    "allowlist": ("GetAllowlistPage", pairing_pb2.GetAllowlistPageRequest, "allowlist_page"),
}


async def pages(
    env: BenchEnv,
    bus: Bus,
    stub: pairing_pb2_grpc.PairingStub,
    token: str,
    agent: uuid.UUID,
    n: int,
    rows: int,
) -> dict[str, Series]:
    rpc = RpcClient(bus)
    metadata = [("authorization", f"Bearer {token}")]
    results: dict[str, Series] = {}
    async with await psycopg.AsyncConnection.connect(env.database_url, autocommit=True) as conn:
        for list_name, (method, request_type, query) in LISTS.items():
            response_type = getattr(pairing_pb2, f"{method}Response")
            for page_name, offset in page_offsets(rows).items():
                request = request_type(agent_id=str(agent), channel="discord", limit=LIMIT, offset=offset)
                params = {
                    "agent_id": agent,
                    "channel": "discord",
                    "ttl": TTL,
                    "limit": LIMIT + 1,
                    "offset": offset,
                }

                async def over_nats(
                    i: int,
                    slot: int,
                    request: object = request,
                    rt: object = response_type,
                    method: str = method,
                ) -> None:
                    reply = await rpc.call("pairing", method, request, rt, timeout=10)  # type: ignore[arg-type]
                    assert len(reply.items) == LIMIT  # type: ignore[attr-defined]

                async def over_grpc(
                    i: int, slot: int, request: object = request, method: str = method
                ) -> None:
                    reply = await getattr(stub, method)(request, metadata=metadata, timeout=10)
                    assert len(reply.items) == LIMIT

                async def raw_sql(
                    i: int,
                    slot: int,
                    params: dict[str, object] = params,
                    sql: str = Q[query],
                    offset: int = offset,
                ) -> None:
                    cur = await conn.execute(sql, params, prepare=True)
                    assert len(await cur.fetchall()) == LIMIT + (offset + LIMIT < rows)

                for how, op in (("nats", over_nats), ("grpc", over_grpc), ("sql", raw_sql)):
                    await timed("warm-up", 20, 1, op)
                    key = f"{list_name}:{page_name}:{how}"
                    results[key] = await timed(f"{list_name} page, {page_name} ({how})", n, 1, op)
    return results


async def upserts(env: BenchEnv, n: int, clients: int) -> dict[str, Series]:
    buses = [
        await Bus.connect(env.nats_url, name=f"bench-{i}", namespace=env.namespace) for i in range(clients)
    ]
    conns = [await psycopg.AsyncConnection.connect(env.database_url, autocommit=True) for _ in range(clients)]
    results: dict[str, Series] = {}
    try:
        rpcs = [RpcClient(bus) for bus in buses]
        run = secrets.token_hex(3)

        made = [0] * clients

        def sender(prefix: str, i: int, slot: int) -> tuple[str, str, str]:
            # Three new senders per channel, each channel written by one client: every upsert
            # creates a request in a free slot (the heaviest path), and no two clients race for
            # a slot, so the raw statement needs no retry either.
            made[slot] += 1
            return str(uuid.UUID(int=slot + 1)), f"{prefix}{run}-{slot}-{made[slot] // 3}", f"u{i}"

        async def service_upsert(i: int, slot: int) -> None:
            agent, channel, sender_id = sender("svc", i, slot)
            reply = await rpcs[slot].call(
                "pairing",
                "UpsertRequest",
                pairing_pb2.UpsertRequestRequest(agent_id=agent, channel=channel, sender_id=sender_id),
                pairing_pb2.UpsertRequestResponse,
                timeout=10,
            )
            assert reply.created

        async def raw_upsert(i: int, slot: int) -> None:
            agent, channel, sender_id = sender("raw", i, slot)
            params = {
                "agent_id": uuid.UUID(agent),
                "channel": channel,
                "sender_id": sender_id,
                "metadata": Jsonb({}),
                "ttl": TTL,
                "max_pending": 3,
                "code": new_code(),
            }
            cur = await conns[slot].execute(Q["upsert_request"], params, prepare=True)
            row = await cur.fetchone()
            assert row is not None
            assert row[0] == "created"

        await conns[0].execute(
            "CREATE TABLE IF NOT EXISTS bench_floor (id int PRIMARY KEY, n bigint NOT NULL)"
        )
        await conns[0].execute(
            "INSERT INTO bench_floor SELECT g, 0 FROM generate_series(0, 63) g ON CONFLICT DO NOTHING"
        )

        async def floor_update(i: int, slot: int) -> None:
            await conns[slot].execute(
                "UPDATE bench_floor SET n = n + 1 WHERE id = %s RETURNING n", (slot,), prepare=True
            )

        async def floor_request_reply(i: int, slot: int) -> None:
            await buses[slot].nc.request(f"{env.namespace}.floor.rr", b"x" * 120, timeout=5)

        async def echo(msg: object) -> None:
            await msg.respond(msg.data)  # type: ignore[attr-defined]

        await buses[0].nc.subscribe(f"{env.namespace}.floor.rr", cb=echo)

        for key, name, op in (
            ("service", f"UpsertRequest, {clients} clients", service_upsert),
            ("sql", f"raw upsert statement, {clients} connections", raw_upsert),
            ("update", f"raw UPDATE … RETURNING, {clients} connections", floor_update),
            ("nats", f"raw NATS request/reply, {clients} connections", floor_request_reply),
        ):
            results[key] = await timed(name, n, clients, op)
        # The measured upserts were all created: warm-up excluded, nothing was full.
    finally:
        for conn in conns:
            await conn.close()
        for bus in buses:
            await bus.close()
    return results


async def main(args: argparse.Namespace) -> None:
    with bench_env() as env:
        token = secrets.token_hex(16)
        agent = uuid.uuid4()
        await seed(env.database_url, agent, args.rows)
        replicas = start_replicas(env, token, args.replicas)
        bus = await Bus.connect(env.nats_url, name="bench", namespace=env.namespace)
        try:
            for replica in replicas:
                await replica.wait_ready()
            async with grpc.aio.insecure_channel(f"127.0.0.1:{replicas[0].grpc_port}") as channel:
                page_series = await pages(
                    env, bus, pairing_pb2_grpc.PairingStub(channel), token, agent, args.pages, args.rows
                )
            upsert_series = await upserts(env, args.upserts, args.clients)
        finally:
            await bus.close()
            for replica in replicas:
                replica.stop()

    def ratio(a: float, b: float) -> float:
        return round(a / b, 2) if b else float("nan")

    page_figures: dict[str, object] = {}
    for list_name in LISTS:
        for page_name in PAGE_NAMES:
            nats = page_series[f"{list_name}:{page_name}:nats"]
            grpc_ = page_series[f"{list_name}:{page_name}:grpc"]
            sql = page_series[f"{list_name}:{page_name}:sql"]
            page_figures[f"{list_name}_{page_name}"] = {
                "nats": nats.figures(),
                "grpc": grpc_.figures(),
                "raw_sql": sql.figures(),
                "nats_p50_ratio_to_sql": ratio(nats.p50_ms, sql.p50_ms),
                "nats_p99_ratio_to_sql": ratio(nats.p99_ms, sql.p99_ms),
                "grpc_p50_ratio_to_sql": ratio(grpc_.p50_ms, sql.p50_ms),
            }
    first_pages = [page_series[f"{name}:first:nats"] for name in LISTS]
    summary: dict[str, object] = {
        "benchmark": "pairing",
        "rows": args.rows,
        "replicas": args.replicas,
        "pages": page_figures,
        "first_page_p99_ms_max": round(max(s.p99_ms for s in first_pages), 3),
        "upserts": {key: series.figures() for key, series in upsert_series.items()},
        "upserts_per_s": round(upsert_series["service"].rate, 1),
        "upsert_ratio_to_raw_upsert_sql": ratio(upsert_series["service"].rate, upsert_series["sql"].rate),
        "upsert_ratio_to_raw_update": ratio(upsert_series["service"].rate, upsert_series["update"].rate),
        "pending_first_page_p50_ratio_to_sql": page_figures["pending_first"]["nats_p50_ratio_to_sql"],  # type: ignore[index]
        "allowlist_first_page_p50_ratio_to_sql": page_figures["allowlist_first"]["nats_p50_ratio_to_sql"],  # type: ignore[index]
    }
    report(
        f"Pairing: pages on {args.rows:,} rows,"
        f" upserts with {args.clients} clients ({args.replicas} replicas)",
        [*page_series.values(), *upsert_series.values()],
        summary,
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pages", type=int, default=300)
    parser.add_argument("--upserts", type=int, default=4000)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--rows", type=int, default=ROWS, help="pending requests and allowlist entries")
    asyncio.run(main(parser.parse_args()))
