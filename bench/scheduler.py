"""Scheduler throughput and due→start lag, against its floor and against procrastinate and PgQueuer.

End to end: one-shot tasks due at one moment are claimed by the scheduler
replicas (real `python -m parley_scheduler` processes), dispatched over NATS to
worker processes built on the worker library (a no-op handler), and completed
(deleted). Measured with 1 and 2 replicas (one worker process per replica), as
tasks/s from the due time until the last task is gone. The due→start lag comes
from a separate run where tasks fall due steadily, as the workers see it.

In the same run:
- the floor: the raw single-statement SKIP LOCKED claim on a plain table with
  4 connections, and a raw NATS request/reply (sequential and 64 in flight);
- the peers: procrastinate and PgQueuer (`pip install -e '.[bench]'`), each
  running the same number of no-op jobs on the same Postgres, one worker process
  per replica with the same concurrency, finished jobs leaving the queue table
  (procrastinate deletes them; PgQueuer moves them to its log).

Usage: python bench/scheduler.py [--tasks 10000] [--concurrency 64] [--lag-tasks 1000] [--lag-rate 200]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import signal
import statistics
import subprocess
import sys
import time
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import IO

import psycopg
from _common import (
    BenchEnv,
    Groups,
    Series,
    bench_env,
    cpu_ms_per_op,
    cpu_snapshot,
    percentile,
    pids_matching,
    report,
    service_nats,
)

from parley.v1 import scheduler_pb2
from parley_devinfra.infra import free_port
from parley_platform.bus import Bus
from parley_platform.rpc import RpcClient
from parley_platform.testing import ServiceProcess

AGENT = str(uuid.uuid4())

# The worker process, on uvloop like a service that hosts workers (parley_platform.lifecycle).
WORKER = r"""
import asyncio, json, os, signal, time
import uvloop
from parley_platform.bus import Bus
from parley_platform.worker import WorkerHost, Workers

async def main():
    lags = []
    workers = Workers()

    @workers.worker("NOOP")
    async def noop(task, lease):
        if task.due_at is not None and task.values.get("lag"):
            lags.append(time.time() - task.due_at.timestamp())

    namespace = os.environ["PARLEY_NAMESPACE"]
    bus = await Bus.connect(os.environ["BENCH_NATS_URL"], name="bench-worker", namespace=namespace)
    concurrency = int(os.environ["BENCH_CONCURRENCY"])
    host = WorkerHost(bus, service="bench", workers=workers, concurrency=concurrency)
    await host.start()
    print("worker ready", flush=True)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    await stop.wait()
    await host.stop(timeout=5)
    await bus.close()
    with open(os.environ["BENCH_LAGS"], "w") as out:
        json.dump(lags, out)

uvloop.run(main())
"""

PROCRASTINATE = r"""
import asyncio, os, sys, time
import procrastinate

app = procrastinate.App(connector=procrastinate.PsycopgConnector(conninfo=os.environ["BENCH_DATABASE_URL"]))

@app.task(name="noop", queue="bench")
async def noop():
    return None

async def main():
    async with app.open_async():
        if sys.argv[1] == "schema":
            await app.schema_manager.apply_schema_async()
            return
        if sys.argv[1] == "defer":
            total = int(sys.argv[2])
            for start in range(0, total, 1000):
                await noop.batch_defer_async(*([{}] * min(1000, total - start)))
            return
        print("ready", flush=True)
        sys.stdin.readline()
        await app.run_worker_async(
            queues=["bench"], concurrency=int(os.environ["BENCH_CONCURRENCY"]), wait=False,
            delete_jobs="always", install_signal_handlers=False,
        )
        print("done", flush=True)

asyncio.run(main())
"""


# PgQueuer: the same three programs. Its worker takes jobs in batches of up to 10 (its default),
# never more than the concurrency at once, and stops once the queue is empty (drain mode); on
# uvloop, as its own command line runs it.
PGQUEUER = r"""
import asyncio, os, sys
from datetime import timedelta
import uvloop
import psycopg
from pgqueuer import PsycopgDriver, Queries, QueueManager
from pgqueuer.types import QueueExecutionMode

async def main():
    conn = await psycopg.AsyncConnection.connect(os.environ["BENCH_DATABASE_URL"], autocommit=True)
    driver = PsycopgDriver(conn)
    if sys.argv[1] == "schema":
        await Queries(driver).install()
        return
    if sys.argv[1] == "defer":
        total = int(sys.argv[2])
        for start in range(0, total, 1000):
            n = min(1000, total - start)
            await Queries(driver).enqueue(["noop"] * n, [None] * n, [0] * n)
        return
    concurrency = int(os.environ["BENCH_CONCURRENCY"])
    qm = QueueManager(Queries(driver))

    @qm.entrypoint("noop")
    async def noop(job):
        return None

    print("ready", flush=True)
    sys.stdin.readline()
    batch = max(1, min(10, concurrency // 2))
    await qm.run(
        dequeue_timeout=timedelta(seconds=1), batch_size=batch, mode=QueueExecutionMode.drain,
        max_concurrent_tasks=concurrency,
    )
    print("done", flush=True)

uvloop.run(main())
"""
PEERS = {"procrastinate": (PROCRASTINATE, "procrastinate_jobs"), "pgqueuer": (PGQUEUER, "pgqueuer")}


def log(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


class Worker:
    def __init__(self, env: dict[str, str], logs: Path, index: int) -> None:
        self.lags_path = logs / f"lags-{index}-{secrets.token_hex(3)}.json"
        self.log_path = logs / f"worker-{index}.log"
        self.env = {**os.environ, **env, "BENCH_LAGS": str(self.lags_path), "PYTHONUNBUFFERED": "1"}
        self.process: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    def start(self) -> Worker:
        self._log = self.log_path.open("ab")
        self.process = subprocess.Popen(
            [sys.executable, "-c", WORKER], env=self.env, stdout=self._log, stderr=subprocess.STDOUT
        )
        return self

    async def ready(self) -> None:
        deadline = time.monotonic() + 30
        while "worker ready" not in self.log_path.read_text(errors="replace"):
            assert self.process is not None
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"bench worker did not start:\n{self.log_path.read_text()[-2000:]}")
            await asyncio.sleep(0.05)

    def stop(self) -> list[float]:
        assert self.process is not None
        self.process.send_signal(signal.SIGTERM)
        self.process.wait(20)
        if self._log:
            self._log.close()
        return list(json.loads(self.lags_path.read_text())) if self.lags_path.exists() else []


async def create(
    rpc: RpcClient, count: int, due: datetime | None, *, lag: bool = False, spread: float = 0
) -> None:
    for start in range(0, count, 1000):
        batch = scheduler_pb2.CreateTasksRequest()
        for i in range(start, min(count, start + 1000)):
            spec = batch.tasks.add(agent_id=AGENT, name="NOOP", tags=["queue"])
            if due is not None:
                spec.due_at.FromDatetime(due + timedelta(seconds=spread * i / max(1, count)))
            if lag:
                spec.metadata.values.update({"lag": True})
        await rpc.call("scheduler", "CreateTasks", batch, scheduler_pb2.CreateTasksResponse, timeout=60)


# How often a run's end is looked for. Each look is a query on the same PostgreSQL, charged to its
# CPU like the run's own: a count(*) every 10 ms scanned the whole queue table (dead rows
# included) 100 times a second, a third of a core on these machines, taken from the run measured.
POLL_SECONDS = 0.02


async def remaining(conn: psycopg.AsyncConnection[object], table: str = "scheduler.task") -> bool:
    """Whether any row is left: stops at the first live one (the measure needs nothing more)."""
    cur = await conn.execute(f"SELECT EXISTS (SELECT 1 FROM {table})")
    row = await cur.fetchone()
    assert row is not None
    return bool(row[0])  # type: ignore[call-overload]


async def until_empty(conn: psycopg.AsyncConnection[object], timeout: float = 300) -> float:
    deadline = time.monotonic() + timeout
    while await remaining(conn):
        if time.monotonic() > deadline:
            raise SystemExit("the scheduler did not finish in time")
        await asyncio.sleep(POLL_SECONDS)
    return time.time()


async def parley_run(env: BenchEnv, replicas: int, args: argparse.Namespace, token: str) -> dict[str, object]:
    namespace = f"{env.namespace}r{replicas}"
    common = {
        **service_nats(env),
        "PARLEY_DATABASE_URL": env.database_url,
        "PARLEY_NAMESPACE": namespace,
        "PARLEY_OPERATOR_TOKEN": token,
        "PARLEY_LOG_LEVEL": "WARNING",
        "PARLEY_ENVIRONMENT": "test",
        "PARLEY_SCHEDULER_MAX_INFLIGHT": str(args.concurrency),
        "BENCH_CONCURRENCY": str(args.concurrency),
        # The worker process stands in for a service's workers; it connects as the operator.
        "BENCH_NATS_URL": env.nats_url,
    }
    schedulers = []
    for _ in range(replicas):
        port = free_port()
        schedulers.append(
            ServiceProcess(
                "parley_scheduler",
                {
                    **common,
                    "PARLEY_SCHEDULER_GRPC_PORT": str(port),
                    "PARLEY_SCHEDULER_METRICS_PORT": str(free_port()),
                },
                env.logs / f"scheduler-{replicas}-{port}.log",
                port,
            ).start()
        )
    workers = [Worker(common, env.logs, i).start() for i in range(replicas)]
    bus = await Bus.connect(env.nats_url, name="bench", namespace=namespace)
    conn = await psycopg.AsyncConnection.connect(env.database_url, autocommit=True)
    try:
        await asyncio.gather(*(s.wait_ready() for s in schedulers), *(w.ready() for w in workers))
        rpc = RpcClient(bus)
        await create(rpc, 500, None)  # warm-up: connections, prepared statements
        await until_empty(conn)

        # Created far ahead, then all made due at one moment by one statement (its NOTIFY wakes
        # the replicas): the measure runs from that moment until the last task is gone.
        await create(rpc, args.tasks, datetime.now(UTC) + timedelta(hours=1))
        cur = await conn.execute(
            "WITH due AS (UPDATE scheduler.task SET next_run_at = now(), ready_at = now() RETURNING id)"
            " SELECT extract(epoch FROM now()) FROM (SELECT count(*) FROM due) AS made_due"
        )
        row = await cur.fetchone()
        assert row is not None
        due = float(row[0])  # type: ignore[arg-type]
        groups = cpu_groups(
            env,
            scheduler=[s.pid for s in schedulers],
            worker=[w.process.pid for w in workers if w.process is not None],
        )
        before = cpu_snapshot(groups)
        finished = await until_empty(conn)
        wall = finished - due
        figures: dict[str, object] = {
            "tasks": args.tasks,
            "seconds": round(wall, 3),
            "tasks_per_s": round(args.tasks / wall, 1),
            "cpu_ms_per_task": cpu_ms_per_op(before, cpu_snapshot(groups), args.tasks),
        }

        if replicas == 1:
            # Steady arrivals: tasks fall due one after another, the scheduler idle in between.
            start = datetime.now(UTC) + timedelta(seconds=2)
            await create(rpc, args.lag_tasks, start, lag=True, spread=args.lag_tasks / args.lag_rate)
            await until_empty(conn)
    finally:
        lags = [lag for w in workers for lag in w.stop()]
        for s in schedulers:
            s.stop()
        await conn.close()
        await bus.close()
    if lags:
        figures["lag_p50_ms"] = round(statistics.median(lags) * 1000, 2)
        figures["lag_p99_ms"] = round(percentile(lags, 99) * 1000, 2)
        figures["lag_n"] = len(lags)
        figures["lag_series"] = lags
    return figures


def cpu_groups(env: BenchEnv, **processes: list[int]) -> Groups:
    """The processes whose CPU a run is charged: its own (by role), PostgreSQL's backends, NATS."""
    database = env.database_url.rsplit("/", 1)[-1]
    return {
        **{role: (lambda pids=pids: pids) for role, pids in processes.items()},
        "postgres": lambda: pids_matching("postgres: ", database),
        "nats": lambda: pids_matching("nats-server", str(env.logs.parent)),
    }


async def peer(
    name: str, env: BenchEnv, concurrency: int, *args: str, stdin: bool = False
) -> asyncio.subprocess.Process:
    """A peer's program (apply the schema, defer jobs, or run a worker) as its own process."""
    return await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        PEERS[name][0],
        *args,
        env={**os.environ, "BENCH_DATABASE_URL": env.database_url, "BENCH_CONCURRENCY": str(concurrency)},
        stdin=asyncio.subprocess.PIPE if stdin else None,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL,
    )


async def peer_run(name: str, env: BenchEnv, processes: int, args: argparse.Namespace) -> dict[str, object]:
    """The peer's jobs deferred first, then its workers started at one moment; until they drained."""
    deferring = await peer(name, env, args.concurrency, "defer", str(args.tasks))
    if await deferring.wait() != 0:
        raise SystemExit(f"{name} could not defer the jobs")
    workers = [await peer(name, env, args.concurrency, "work", stdin=True) for _ in range(processes)]
    for worker in workers:
        assert worker.stdout is not None
        if (await worker.stdout.readline()).strip() != b"ready":
            raise SystemExit(f"a {name} worker did not start")
    # Measured like Parley's run: until the queue table is empty, not until the workers exit
    # (their shutdown is no part of the work).
    table = PEERS[name][1]
    groups = cpu_groups(env, worker=[w.pid for w in workers])
    async with await psycopg.AsyncConnection.connect(env.database_url, autocommit=True) as conn:
        before = cpu_snapshot(groups)
        started = time.time()
        for worker in workers:
            assert worker.stdin is not None
            worker.stdin.write(b"go\n")
            await worker.stdin.drain()
        deadline = time.monotonic() + 600
        while await remaining(conn, table):
            if time.monotonic() > deadline:
                raise SystemExit(f"{name} did not finish in time")
            await asyncio.sleep(POLL_SECONDS)
        wall = time.time() - started
        spent = cpu_ms_per_op(before, cpu_snapshot(groups), args.tasks)
    for worker in workers:
        await asyncio.wait_for(worker.wait(), 60)
    return {
        "tasks": args.tasks,
        "seconds": round(wall, 3),
        "tasks_per_s": round(args.tasks / wall, 1),
        "cpu_ms_per_task": spent,
    }


async def floor_claim(env: BenchEnv, n: int, connections: int = 4) -> Series:
    async with await psycopg.AsyncConnection.connect(env.database_url, autocommit=True) as conn:
        await conn.execute("DROP TABLE IF EXISTS bench_claim")
        await conn.execute("CREATE TABLE bench_claim (id bigint PRIMARY KEY, status text NOT NULL)")
        await conn.execute("CREATE INDEX bench_claim_todo ON bench_claim (id) WHERE status = 'todo'")
        await conn.execute("INSERT INTO bench_claim SELECT g, 'todo' FROM generate_series(1, %s) g", (n,))
        await conn.execute("VACUUM ANALYZE bench_claim")
    latencies: list[float] = []

    async def claimer() -> None:
        async with await psycopg.AsyncConnection.connect(env.database_url, autocommit=True) as conn:
            while True:
                t = time.perf_counter()
                cur = await conn.execute(
                    "UPDATE bench_claim SET status = 'running' WHERE id = ("
                    " SELECT id FROM bench_claim WHERE status = 'todo'"
                    " ORDER BY id LIMIT 1 FOR UPDATE SKIP LOCKED) RETURNING id",
                    prepare=True,
                )
                if await cur.fetchone() is None:
                    return
                latencies.append(time.perf_counter() - t)

    started = time.perf_counter()
    await asyncio.gather(*(claimer() for _ in range(connections)))
    return Series(
        f"floor: SKIP LOCKED claim, {connections} connections", latencies, time.perf_counter() - started
    )


async def floor_nats(env: BenchEnv, n: int, in_flight: int) -> list[Series]:
    bus = await Bus.connect(env.nats_url, name="bench-floor", namespace=env.namespace)
    subject = f"{env.namespace}.floor.rr"

    async def echo(msg: object) -> None:
        await msg.respond(msg.data)  # type: ignore[attr-defined]

    await bus.nc.subscribe(subject, cb=echo)
    results = []
    try:
        for flight in (1, in_flight):
            latencies: list[float] = []
            queue = list(range(n))

            async def one(queue: list[int] = queue, latencies: list[float] = latencies) -> None:
                while queue:
                    queue.pop()
                    t = time.perf_counter()
                    await bus.nc.request(subject, b"x" * 300, timeout=5)
                    latencies.append(time.perf_counter() - t)

            started = time.perf_counter()
            await asyncio.gather(*(one() for _ in range(flight)))
            results.append(
                Series(
                    f"floor: NATS request/reply, {flight} in flight", latencies, time.perf_counter() - started
                )
            )
    finally:
        await bus.close()
    return results


def throughput_row(name: str, figures: dict[str, object]) -> Series:
    # A row for the table: the rate is what matters; latencies are not per task here.
    seconds = float(figures["seconds"])  # type: ignore[arg-type]
    count = int(figures["tasks"])  # type: ignore[call-overload]
    return Series(name, [seconds / count] * count, seconds)


async def main(args: argparse.Namespace) -> None:
    try:
        import pgqueuer  # noqa: F401
        import procrastinate  # noqa: F401
    except ImportError:
        raise SystemExit("a peer is missing: pip install -e '.[bench]'") from None
    with bench_env() as env:
        env.logs.mkdir(parents=True, exist_ok=True)
        token = secrets.token_hex(16)
        log("floor: raw claim and NATS round trip")
        claim = await floor_claim(env, args.tasks)
        nats_seq, nats_conc = await floor_nats(env, 2000, 64)
        log("parley, 1 replica")
        one = await parley_run(env, 1, args, token)
        log("parley, 2 replicas")
        two = await parley_run(env, 2, args, token)
        peers: dict[str, dict[int, dict[str, object]]] = {}
        for name in PEERS:
            log(f"{name}: schema")
            if await (await peer(name, env, 1, "schema")).wait() != 0:
                raise SystemExit(f"{name} could not install its schema")
            for processes in (1, 2):
                log(f"{name}, {processes} process(es)")
                peers.setdefault(name, {})[processes] = await peer_run(name, env, processes, args)

    lags = one.pop("lag_series", [])
    rows = [
        throughput_row("parley: 1 replica + 1 worker, end to end", one),
        throughput_row("parley: 2 replicas + 2 workers, end to end", two),
        *(
            throughput_row(f"{name}: {n} worker process(es)", figures)
            for name, runs in peers.items()
            for n, figures in runs.items()
        ),
        Series(
            "parley: due→start lag (steady arrivals)",
            list(lags),
            len(lags) / args.lag_rate,  # type: ignore[arg-type]
        ),
        claim,
        nats_seq,
        nats_conc,
    ]
    summary: dict[str, object] = {
        "benchmark": "scheduler",
        "concurrency": args.concurrency,
        "parley_1_replica": one,
        "parley_2_replicas": two,
        "procrastinate_1_process": peers["procrastinate"][1],
        "procrastinate_2_processes": peers["procrastinate"][2],
        "pgqueuer_1_process": peers["pgqueuer"][1],
        "pgqueuer_2_processes": peers["pgqueuer"][2],
        "floor": {
            "skip_locked_claim_4_connections": claim.figures(),
            "nats_request_reply_1": nats_seq.figures(),
            "nats_request_reply_64": nats_conc.figures(),
        },
        **{
            f"ratio_to_{name}_{n}": round(float(mine["tasks_per_s"]) / float(runs[n]["tasks_per_s"]), 2)  # type: ignore[arg-type]
            for name, runs in peers.items()
            for n, mine in ((1, one), (2, two))
        },
        "ratio_to_floor_claim_1": round(float(one["tasks_per_s"]) / claim.rate, 2),  # type: ignore[arg-type]
        "ratio_to_floor_claim_2": round(float(two["tasks_per_s"]) / claim.rate, 2),  # type: ignore[arg-type]
        "lag_p50_ms": one.get("lag_p50_ms"),
        "lag_p99_ms": one.get("lag_p99_ms"),
    }
    runs = {"parley, 1 replica": one, "parley, 2 replicas": two}
    runs.update({f"{name}, {n} process(es)": f for name, r in peers.items() for n, f in r.items()})
    for label, figures in runs.items():
        spent = figures["cpu_ms_per_task"]
        assert isinstance(spent, dict)
        by_process = ", ".join(f"{k.removesuffix('_cpu_ms')} {v:.3f}" for k, v in spent.items())
        print(f"CPU ms per task, {label}: {by_process}")
    report(
        f"Scheduler: {args.tasks} one-shot tasks, concurrency {args.concurrency} (rates in tasks/s)",
        rows,
        summary,
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=10_000)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--lag-tasks", type=int, default=1000)
    parser.add_argument(
        "--lag-rate", type=float, default=200.0, help="tasks falling due per second in the lag run"
    )
    asyncio.run(main(parser.parse_args()))
