"""Turn throughput with 1 and 3 runtime replicas, against its own floor, and the round trips of a turn.

A client keeps ``--in-flight`` turns going (each slot its own room, so 64 rooms and no turn is
superseded) through the real pipeline: runtime replicas and the model gateway run as processes,
the scripted model answers at zero latency. It measures turns/s and p50/p99 latency with one
replica, then with three (two more join the same durable consumer), then the floor in the same
run: raw JetStream publish→consume, JetStream publish, NATS request/reply and one SQL statement
(``turn_latency.floors``).

Meanwhile it reads the CPU time each service process spent per turn (/proc), and how many of the
machine's cores were busy: on a shared 2-core machine that says whether turns/s is bound by CPU.

It also counts what one turn costs, measured rather than assumed: over ``--census`` sequential
turns, a wildcard NATS subscriber counts every message by kind (model RPCs, JetStream publishes,
fetches, acks, events) and PostgreSQL's own transaction counters count the SQL statements (the
services run in autocommit: one statement, one transaction; the gateway gets a database of its
own here so that the runtime's statements are counted apart). The floor is
given twice: with the legs the turn needs before its reply (1 model call, the ingest and save
statements) as in turn_latency.py, and with every round trip the census found, background work
after the reply (message embeddings, the REFLECTION evaluator) included.

Usage: python bench/turn_throughput.py [--turns 3000] [--in-flight 64] [--census 200] [--floor-n 300]
       [--settle 11]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import time
from pathlib import Path
from typing import Any

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
    service_process,
    suite_env,
)
from turn_latency import Client, floors, timed

from parley_platform.bus import Bus
from parley_platform.testing import ServiceProcess, create_database, drop_database

# Read from the code (parley_runtime/turn.py, default character, DM room, no stored facts,
# trajectory logging off): what a turn waits for before its reply is published and acked, and
# what runs after it in the background. The census below measures the totals.
# The ingest statement also reads the custom actions' revision and whether facts and documents
# exist (three statements of their own before). A turn's embeddings are at most one call and one
# statement, shared by the turns that finish within PARLEY_EMBEDDING_BATCH_WINDOW_MS (the census
# counts how many there were).
SQL_BEFORE_REPLY = {"ingest (with the room's lock, one transaction)": 1, "save_replies": 1}
SQL_AFTER_REPLY = {"set_embeddings (message + reply; shared, at most)": 1}
NATS_BEFORE_REPLY = {"model GenerateStream": 1, "outbound JetStream publish": 1}
NATS_AFTER_REPLY = {
    "model Embed (shared, at most)": 1,
    "model Generate (REFLECTION, small; characters with evaluators)": 1,
}
NATS_NO_REPLY = {
    "ack": 1,
    "events (RUN_STARTED … RUN_ENDED)": 5,
    "reply chunks (core; as many as the reply streams in, plus the final one)": 1,
    "room taken (core, to every runtime replica; when the room had turns before)": 1,
}
ESSENTIAL_SQL, ESSENTIAL_RPC = 2, 1  # what turn_latency.py's floor counts


def classify(subject: str, ns: str) -> str:
    if subject.startswith(f"{ns}.model.stream."):
        return "control of a streamed model call (ping or cancel, no reply)"
    if subject.startswith(f"{ns}.model."):
        return f"model {subject.rsplit('.', 1)[-1]} (request/reply)"
    for prefix, kind in (
        (f"{ns}.inbound.", "inbound (the client's publish, its delivery to the runtime)"),
        (f"{ns}.outbound.", "outbound JetStream publish (waits for its ack)"),
        (f"{ns}.events.", "event publish (core, no reply)"),
        (f"{ns}.stream.", "reply chunk publish (core, no reply)"),
        (f"{ns}.runtime.rooms.taken", "room taken (core broadcast to the runtime replicas)"),
        ("$JS.API.CONSUMER.MSG.NEXT.", "pull fetch request"),
        ("$JS.ACK.", "ack (no reply awaited)"),
        ("$JS.API.", "other JetStream API request"),
        ("_INBOX.", "replies (RPC responses, publish acks, fetched messages)"),
    ):
        if subject.startswith(prefix):
            return kind
    return f"other: {subject.split('.', 1)[0]}"


def database_name(url: str) -> str:
    return url.rsplit("/", 1)[-1].split("?", 1)[0]


async def database_transactions(env: BenchEnv, databases: dict[str, str]) -> dict[str, int]:
    """Committed + rolled back transactions of each database, read from the server's maintenance
    database so that reading does not count."""
    async with await psycopg.AsyncConnection.connect(env.server_database_url, autocommit=True) as conn:
        cur = await conn.execute(
            "SELECT datname, xact_commit + xact_rollback FROM pg_stat_database WHERE datname = ANY(%s)",
            (list(databases.values()),),
        )
        found = {str(name): int(count) for name, count in await cur.fetchall()}
    return {key: found[name] for key, name in databases.items()}


async def settled_transactions(
    env: BenchEnv,
    databases: dict[str, str],
    quiet: float = 11.0,
    limit: float = 45.0,
    *,
    past: dict[str, int] | None = None,
) -> dict[str, int]:
    """The counters once they stop moving. A backend that goes idle within a second of its last
    report holds its counts for up to 10 s (PGSTAT_IDLE_INTERVAL), so wait longer than that.
    With ``past``, first wait until every counter has gone beyond it: a short ``quiet`` (a tiny
    run) could otherwise end before any backend reported the work just done."""
    deadline = time.monotonic() + limit
    last = await database_transactions(env, databases)
    while past is not None and any(last[k] <= past[k] for k in past) and time.monotonic() < deadline:
        await asyncio.sleep(0.25)
        last = await database_transactions(env, databases)
    while True:
        await asyncio.sleep(quiet)
        now = await database_transactions(env, databases)
        if now == last or time.monotonic() > deadline:
            return now
        last = now


async def census(
    env: BenchEnv, bus: Bus, client: Client, n: int, gateway_database: str, settle: float
) -> dict[str, Any]:
    """Every NATS message and SQL statement of ``n`` sequential turns, per turn. The runtime and
    the gateway have a database each here, so each one's statements are counted apart."""
    kinds: collections.Counter[str] = collections.Counter()
    counting = False
    databases = {"runtime": database_name(env.database_url), "gateway": gateway_database}

    async def count(msg: Any) -> None:
        if counting:
            kinds[classify(msg.subject, env.namespace)] += 1

    sub = await bus.nc.subscribe(">", cb=count)
    before = await settled_transactions(env, databases, quiet=settle)
    counting = True
    await timed(n, 1, client.turn)
    await asyncio.sleep(1.0)  # background work of these turns ends
    counting = False
    await sub.unsubscribe()
    # Every turn runs statements in the runtime's database; the gateway's is counted apart.
    after = await settled_transactions(env, databases, quiet=settle, past={"runtime": before["runtime"]})
    per_turn = {kind: round(count / n, 2) for kind, count in sorted(kinds.items())}
    model_calls = sum(v for k, v in per_turn.items() if k.startswith("model "))
    round_trips = model_calls + sum(
        per_turn.get(k, 0.0)
        for k in (
            "outbound JetStream publish (waits for its ack)",
            "pull fetch request",
            "other JetStream API request",
        )
    )
    return {
        "turns": n,
        "sql_statements_per_turn": round((after["runtime"] - before["runtime"]) / n, 2),
        "gateway_sql_statements_per_turn": round((after["gateway"] - before["gateway"]) / n, 2),
        "nats_messages_per_turn": per_turn,
        "nats_round_trips_per_turn": round(round_trips, 2),
        "model_calls_per_turn": round(model_calls, 2),
    }


def machine_busy() -> tuple[float, float]:
    """(busy, total) CPU time of the whole machine so far, in clock ticks (Linux /proc/stat)."""
    try:
        ticks = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except OSError:
        return 0.0, 0.0
    idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)
    return float(sum(ticks) - idle), float(sum(ticks))


async def throughput(
    client: Client, turns: int, in_flight: int, name: str, groups: Groups
) -> tuple[Series, dict[str, float]]:
    """Turns/s and latency at ``in_flight``, and the CPU each part of the suite spent per turn."""
    await timed(min(turns, 300), in_flight, client.turn)  # warm-up: connections, prepared statements
    before = cpu_snapshot(groups)
    busy, total = machine_busy()
    series = await timed(turns, in_flight, client.turn)
    series.name = name
    busy_after, total_after = machine_busy()
    after = cpu_snapshot(groups)
    costs = cpu_ms_per_op(before, after, turns)
    cores = os.cpu_count() or 1
    spent_ms = sum(costs.values())
    costs["suite_cpu_ms"] = round(spent_ms, 3)
    if spent_ms:
        costs["cpu_bound_turns_per_s"] = round(cores * 1000 / spent_ms, 1)
    if total_after > total:
        costs["machine_cores_busy"] = round((busy_after - busy) / (total_after - total) * cores, 2)
    return series, costs


async def main(args: argparse.Namespace) -> None:
    with bench_env() as env:
        settings = suite_env(env)
        gateway_database = f"{database_name(env.database_url)}_gateway"
        gateway_url = create_database(env.server_database_url, gateway_database)
        gateway = service_process(
            "parley_gateway", env, {**settings, "PARLEY_DATABASE_URL": gateway_url}, "gateway"
        ).start()
        runtimes: list[ServiceProcess] = []
        bus = await Bus.connect(env.nats_url, name="bench", namespace=env.namespace)
        try:
            await gateway.wait_ready()
            runtimes.append(service_process("parley_runtime", env, settings, "runtime-1").start())
            await runtimes[0].wait_ready()
            client = Client(bus)
            await client.start()
            groups: Groups = {
                "runtime": lambda: [r.pid for r in runtimes],
                "gateway": lambda: [gateway.pid],
                # Backends of both benchmark databases (the gateway's name extends the runtime's).
                "postgres": lambda: pids_matching("postgres: ", database_name(env.database_url)),
                "nats": lambda: pids_matching("nats-server", str(env.logs.parent)),
                "client": lambda: [os.getpid()],
            }
            one, one_cpu = await throughput(
                client,
                args.turns,
                args.in_flight,
                f"turns, 1 replica, {args.in_flight} in flight",
                groups,
            )
            counted = await census(env, bus, client, args.census, gateway_database, args.settle)
            for i in (2, 3):
                runtimes.append(service_process("parley_runtime", env, settings, f"runtime-{i}").start())
            for runtime in runtimes[1:]:
                await runtime.wait_ready()
            three, three_cpu = await throughput(
                client,
                args.turns,
                args.in_flight,
                f"turns, 3 replicas, {args.in_flight} in flight",
                groups,
            )
            floor = await floors(env, bus, args.floor_n, args.in_flight)
        finally:
            await bus.close()
            for runtime in runtimes:
                runtime.stop()
            gateway.stop()
            drop_database(env.server_database_url, gateway_database)

    def rate(key: str) -> float:
        return floor[key].rate

    # Throughput floor: each leg at its own concurrent rate, one after another for every turn
    # (inbound publish, model calls, SQL statements, reply publish), as in turn_latency.py: the
    # irreducible turn is one model call and two statements (ingest, save).
    reply_path = (
        2 / rate("js publish:n")
        + ESSENTIAL_RPC / rate("nats request/reply:n")
        + ESSENTIAL_SQL / rate("sql statement:n")
    )
    measured_path = (
        2 / rate("js publish:n")
        + counted["model_calls_per_turn"] / rate("nats request/reply:n")
        + counted["sql_statements_per_turn"] / rate("sql statement:n")
    )
    floor_minimal, floor_measured = 1 / reply_path, 1 / measured_path
    floor_latency_ms = (
        floor["js publish→consume:1"].p50_ms
        + floor["nats request/reply:1"].p50_ms
        + ESSENTIAL_SQL * floor["sql statement:1"].p50_ms
        + floor["js publish:1"].p50_ms
    )
    best = max(one, three, key=lambda series: series.rate)
    summary: dict[str, object] = {
        "benchmark": "turn_throughput",
        # The best configuration at this many turns in flight (1 or 3 replicas).
        "turns_per_s": round(best.rate, 1),
        "turns_per_s_configuration": best.name,
        "turns_1_replica": {**one.figures(), **one_cpu, "in_flight": args.in_flight, "rooms": args.in_flight},
        "turns_3_replicas": {
            **three.figures(),
            **three_cpu,
            "in_flight": args.in_flight,
            "rooms": args.in_flight,
        },
        "scale_1_to_3": round(three.rate / one.rate, 2),
        "floor": {key: series.figures() for key, series in floor.items()},
        "floor_turn_throughput_per_s": round(floor_minimal, 1),
        "floor_turn_throughput_measured_round_trips_per_s": round(floor_measured, 1),
        "floor_turn_sequential_p50_ms": round(floor_latency_ms, 3),
        "ratio_1_replica_to_floor": round(one.rate / floor_minimal, 2),
        "ratio_3_replicas_to_floor": round(three.rate / floor_minimal, 2),
        "ratio_3_replicas_to_measured_floor": round(three.rate / floor_measured, 2),
        "round_trips_per_turn": {
            "measured": counted,
            "from_code": {
                "sql_before_reply": SQL_BEFORE_REPLY,
                "sql_after_reply": SQL_AFTER_REPLY,
                "sql_total": sum(SQL_BEFORE_REPLY.values()) + sum(SQL_AFTER_REPLY.values()),
                "nats_round_trips_before_reply": NATS_BEFORE_REPLY,
                "nats_round_trips_after_reply": NATS_AFTER_REPLY,
                "nats_round_trips_total": sum(NATS_BEFORE_REPLY.values()) + sum(NATS_AFTER_REPLY.values()),
                "nats_fire_and_forget": NATS_NO_REPLY,
                "floor_counts": {"sql": ESSENTIAL_SQL, "model_calls": ESSENTIAL_RPC},
            },
        },
        "target_turns_per_s": 300,
        "sql_statements_per_turn": counted["sql_statements_per_turn"],
        "nats_round_trips_per_turn": counted["nats_round_trips_per_turn"],
        "cpu_ms_per_turn_3_replicas": {k: v for k, v in three_cpu.items() if k.endswith("_cpu_ms")},
        "suite_cpu_ms_per_turn_3_replicas": three_cpu.get("suite_cpu_ms"),
        "runtime_cpu_ms_per_turn_3_replicas": three_cpu.get("runtime_cpu_ms"),
        "postgres_cpu_ms_per_turn_3_replicas": three_cpu.get("postgres_cpu_ms"),
        "cpu_bound_turns_per_s_3_replicas": three_cpu.get("cpu_bound_turns_per_s"),
        "machine_cores_busy_3_replicas": three_cpu.get("machine_cores_busy"),
    }
    report(
        "Turn throughput (scripted model, zero latency; 1 then 3 runtimes, 1 gateway; "
        f"{args.in_flight} rooms)",
        [one, three, *floor.values()],
        summary,
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=3000)
    parser.add_argument("--in-flight", type=int, default=64)
    parser.add_argument("--census", type=int, default=200)
    parser.add_argument("--floor-n", type=int, default=300)
    parser.add_argument(
        "--settle",
        type=float,
        default=11.0,
        help="seconds the statement counters must stay still around the census (a shorter wait,"
        " for a smoke run, may count a backend's statements late)",
    )
    asyncio.run(main(parser.parse_args()))
