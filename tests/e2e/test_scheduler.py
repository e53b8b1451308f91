"""The scheduler as real processes: replicas of `python -m parley_scheduler` and worker processes
built on the worker library, over real NATS and Postgres. Every worker run is recorded in the
database by the worker itself (one row per task id and attempt), so the tests count executions.

The spec's acceptance cases, the exactly-once proof (10,000 one-shot tasks, 3 scheduler replicas,
4 worker processes), and the same with a scheduler and a worker killed with SIGKILL mid-run.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import os
import re
import secrets
import subprocess
import sys
import time
import urllib.request
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import IO, Any

import grpc
import psycopg
import pytest
from google.protobuf.field_mask_pb2 import FieldMask

from parley.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc
from parley_cli.main import main as cli_main
from parley_devinfra.infra import free_port
from parley_platform import frames
from parley_platform.bus import Bus
from parley_platform.errors import InvalidArgument, NotFound
from parley_platform.postgres import Database, migrate
from parley_platform.rpc import RpcClient
from parley_platform.testing import ServiceProcess, create_database, drop_database, eventually
from parley_scheduler import domain, rules
from parley_scheduler.store import (
    MIGRATIONS_DIR,
    SCHEMA,
    Claimed,
    SchedulerStore,
    insert_row,
    run_completion_row,
)
from support import SessionEnv

# A service offering workers, as any Parley service would: the worker library, a bus, handlers.
# Each handler records its run (task id, attempt, lease owner, times) before it answers; the
# records are written in small group commits so that 10,000 runs stay cheap.
WORKER_PROGRAM = r"""
import asyncio, os, signal, time
from datetime import UTC, datetime
import psycopg
from parley_platform.bus import Bus
from parley_platform.worker import TaskFailed, TaskResult, WorkerHost, Workers

class Recorder:
    def __init__(self, url):
        self.url, self.pending, self.ready = url, [], asyncio.Event()

    async def start(self):
        self.conn = await psycopg.AsyncConnection.connect(self.url, autocommit=True)
        asyncio.create_task(self.loop())

    async def add(self, *row):
        done = asyncio.get_running_loop().create_future()
        self.pending.append((row, done))
        self.ready.set()
        await done

    async def loop(self):
        while True:
            await self.ready.wait()
            self.ready.clear()
            batch, self.pending = self.pending, []
            if not batch:
                continue
            rows = [r for r, _ in batch]
            await self.conn.execute(
                "INSERT INTO e2e_runs (task_id, attempt, owner, pid, worker, marker, started_at, finished_at,"
                " token, slot)"
                " SELECT * FROM unnest(%s::uuid[], %s::int[], %s::text[], %s::int[], %s::text[], %s::text[],"
                " %s::timestamptz[], %s::timestamptz[], %s::bigint[], %s::timestamptz[])",
                [list(col) for col in zip(*rows)],
            )
            for _, done in batch:
                done.set_result(None)

async def main():
    recorder = Recorder(os.environ["E2E_DATABASE_URL"])
    await recorder.start()
    workers = Workers()
    pid = os.getpid()

    async def run(task, lease):
        started = datetime.now(UTC)
        if task.values.get("sleep_ms"):
            await asyncio.sleep(task.values["sleep_ms"] / 1000)
        marker = str(task.values.get("run", ""))
        finished = datetime.now(UTC)
        # The slot a run was claimed for is the next run time of the task it was sent.
        slot = task.proto.next_run_at.ToDatetime(tzinfo=UTC) if task.proto.HasField("next_run_at") else None
        await recorder.add(
            task.id, lease.attempt, lease.owner, pid, task.name, marker, started, finished, lease.token, slot
        )

    @workers.worker("RECORD")
    async def record(task, lease):
        await run(task, lease)

    @workers.worker("FAIL")
    async def fail(task, lease):
        await run(task, lease)
        raise TaskFailed("always fails")

    @workers.worker("ADAPT")
    async def adapt(task, lease):
        await run(task, lease)
        return TaskResult(next_interval_ms=task.values["next_interval_ms"])

    @workers.worker("LATE")
    async def late(task, lease):
        await run(task, lease)

    @workers.worker("HANG")
    async def hang(task, lease):
        # With E2E_HANG set the run never ends (it heartbeats until the process is killed).
        if os.environ.get("E2E_HANG"):
            print("hanging", task.id, lease.attempt, flush=True)
            await asyncio.Event().wait()
        await run(task, lease)

    served = Workers()
    for name in os.environ["E2E_WORKERS"].split(","):
        served.add(name, workers.get(name))
    namespace = os.environ["PARLEY_NAMESPACE"]
    bus = await Bus.connect(os.environ["E2E_NATS_URL"], name="e2e-worker", namespace=namespace)
    concurrency = int(os.environ.get("E2E_CONCURRENCY", "64"))
    host = WorkerHost(bus, service="e2e-worker", workers=served, concurrency=concurrency)
    await host.start()
    print("worker ready", pid, flush=True)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    await stop.wait()
    await host.stop(timeout=5)
    await bus.close()

asyncio.run(main())
"""

RUNS_TABLE = """
CREATE TABLE IF NOT EXISTS e2e_runs (
    task_id uuid NOT NULL, attempt int NOT NULL, owner text NOT NULL, pid int NOT NULL, worker text NOT NULL,
    marker text NOT NULL, started_at timestamptz NOT NULL, finished_at timestamptz NOT NULL,
    token bigint NOT NULL, slot timestamptz
);
CREATE INDEX IF NOT EXISTS e2e_runs_task ON e2e_runs (task_id);
CREATE INDEX IF NOT EXISTS e2e_runs_marker ON e2e_runs (marker);
"""

SCHEDULER_SETTINGS = {
    "PARLEY_SCHEDULER_LEASE_SECONDS": "2",
    "PARLEY_SCHEDULER_NO_WORKER_GRACE_SECONDS": "1",
    "PARLEY_SCHEDULER_MAINTENANCE_SECONDS": "0.3",
    "PARLEY_SCHEDULER_POLL_INTERVAL_SECONDS": "2",
    "PARLEY_SCHEDULER_TASK_TIMEOUT_SECONDS": "30",
}


@dataclass
class WorkerProcess:
    env: dict[str, str]
    log_path: Path
    process: subprocess.Popen[bytes] | None = None
    _log: IO[bytes] | None = None

    def start(self) -> WorkerProcess:
        self._log = self.log_path.open("ab")
        self.process = subprocess.Popen(
            [sys.executable, "-c", WORKER_PROGRAM],
            env=self.env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        return self

    async def wait_ready(self, timeout: float = 30) -> None:
        async def ready() -> bool:
            assert self.process is not None
            if self.process.poll() is not None:
                raise AssertionError(f"worker exited: {self.log_path.read_text()[-3000:]}")
            return "worker ready" in self.log_path.read_text(errors="replace")

        await eventually(ready, timeout=timeout, interval=0.05, what="the worker process to start")

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5)
        if self._log:
            self._log.close()


@dataclass
class SchedulerSuite:
    """Scheduler replicas and worker processes sharing one database and one NATS namespace."""

    env: SessionEnv
    database_url: str
    namespace: str
    logs: Path
    schedulers: list[ServiceProcess] = field(default_factory=list)
    workers: list[WorkerProcess] = field(default_factory=list)

    def service_env(self, **extra: str) -> dict[str, str]:
        return self.env.service_env(
            PARLEY_DATABASE_URL=self.database_url,
            PARLEY_NAMESPACE=self.namespace,
            **{**SCHEDULER_SETTINGS, **extra},
        )

    def scheduler(self, **extra: str) -> ServiceProcess:
        port = free_port()
        env = self.service_env(
            PARLEY_SCHEDULER_GRPC_PORT=str(port), PARLEY_SCHEDULER_METRICS_PORT=str(free_port()), **extra
        )
        process = ServiceProcess("parley_scheduler", env, self.logs / f"scheduler-{port}.log", port)
        self.schedulers.append(process)
        return process.start()

    def worker(self, names: str = "RECORD,FAIL,ADAPT", **extra: str) -> WorkerProcess:
        env = {
            **os.environ,
            **self.service_env(),
            "E2E_DATABASE_URL": self.database_url,
            "E2E_WORKERS": names,
            # The workers stand in for a service's; they connect as the operator (any task name).
            "E2E_NATS_URL": self.env.nats_url,
            "PYTHONUNBUFFERED": "1",
            **extra,
        }
        process = WorkerProcess(env, self.logs / f"worker-{len(self.workers)}.log")
        self.workers.append(process)
        return process.start()

    async def start(self, schedulers: int, workers: int, **scheduler_env: str) -> SchedulerSuite:
        started = [self.scheduler(**scheduler_env) for _ in range(schedulers)]
        spawned = [self.worker() for _ in range(workers)]
        await asyncio.gather(*(s.wait_ready() for s in started), *(w.wait_ready() for w in spawned))
        return self

    def stop(self) -> None:
        for process in self.workers:
            process.stop()
        for scheduler in self.schedulers:
            scheduler.stop()

    def stub(self, index: int = 0) -> tuple[grpc.aio.Channel, scheduler_pb2_grpc.SchedulerStub]:
        alive = [s for s in self.schedulers if s.process is not None and s.process.poll() is None]
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{alive[index].grpc_port}")
        return channel, scheduler_pb2_grpc.SchedulerStub(channel)

    @property
    def metadata(self) -> list[tuple[str, str]]:
        return [("authorization", f"Bearer {self.env.token}")]


@pytest.fixture(scope="module")
def scheduler_database(test_env: SessionEnv) -> Iterator[str]:
    name = f"parley_sched_{secrets.token_hex(4)}"
    url = create_database(test_env.server_database_url, name)
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(RUNS_TABLE)
    yield url
    drop_database(test_env.server_database_url, name)


@pytest.fixture(scope="module")
async def sched(
    test_env: SessionEnv, scheduler_database: str, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[SchedulerSuite]:
    """Three scheduler replicas and two worker processes, shared by the tests of this module."""
    suite = SchedulerSuite(
        test_env, scheduler_database, f"s{secrets.token_hex(4)}", tmp_path_factory.mktemp("scheduler-logs")
    )
    try:
        yield await suite.start(schedulers=3, workers=2)
    finally:
        suite.stop()


@pytest.fixture
async def api(sched: SchedulerSuite) -> AsyncIterator[Api]:
    channel, stub = sched.stub()
    agent = str(uuid.uuid4())
    yield Api(stub, sched.metadata, agent, sched.database_url)
    await channel.close()
    # Each test's tasks belong to an agent of its own; remove what it left running.
    async with await psycopg.AsyncConnection.connect(sched.database_url, autocommit=True) as conn:
        await conn.execute("DELETE FROM scheduler.task WHERE agent_id = %s", (agent,))


@dataclass
class Api:
    stub: scheduler_pb2_grpc.SchedulerStub
    metadata: list[tuple[str, str]]
    agent: str
    database_url: str

    async def create(
        self,
        name: str,
        *,
        repeat: bool = False,
        queue: bool = True,
        due: datetime | None = None,
        values: dict[str, Any] | None = None,
        **meta: Any,
    ) -> scheduler_pb2.Task:
        spec = scheduler_pb2.TaskSpec(
            agent_id=self.agent,
            name=name,
            tags=(["queue"] if queue else []) + (["repeat"] if repeat else []),
            metadata=scheduler_pb2.TaskMetadata(**meta),
        )
        if due is not None:
            spec.due_at.FromDatetime(due)
        if values:
            spec.metadata.values.update(values)
        reply = await self.stub.CreateTask(
            scheduler_pb2.CreateTaskRequest(task=spec), metadata=self.metadata, timeout=10
        )
        return reply.task

    async def get(self, task_id: str) -> scheduler_pb2.Task | None:
        reply = await self.stub.GetTaskStatus(
            scheduler_pb2.GetTaskStatusRequest(id=task_id), metadata=self.metadata, timeout=10
        )
        return reply.task if reply.HasField("task") else None

    async def runs(self, task_id: str) -> list[tuple[int, datetime, datetime, str]]:
        async with await psycopg.AsyncConnection.connect(self.database_url) as conn:
            cur = await conn.execute(
                "SELECT attempt, started_at, finished_at, owner FROM e2e_runs WHERE task_id = %s"
                " ORDER BY started_at",
                (task_id,),
            )
            return list(await cur.fetchall())

    async def count(self, task_id: str) -> int:
        return len(await self.runs(task_id))


def now() -> datetime:
    return datetime.now(UTC)


async def elapsed(seconds: float) -> None:
    """Wait out a time window that is itself under test (a cadence), polling the clock."""
    end = time.monotonic() + seconds

    async def over() -> bool:
        return time.monotonic() >= end

    await eventually(over, timeout=seconds + 5, interval=0.05, what=f"{seconds}s to pass")


# --- acceptance cases ------------------------------------------------------------------------------


async def test_repeat_task_keeps_its_cadence_and_never_overlaps_across_three_replicas(api: Api) -> None:
    tasks = [
        await api.create("RECORD", repeat=True, due=now(), update_interval_ms=1000, values={"sleep_ms": 150})
        for _ in range(3)
    ]

    async def started() -> bool:
        return all([await api.count(t.id) for t in tasks])

    await eventually(started, timeout=10, what="every repeat task's first run")
    await elapsed(10.2)
    owners: set[str] = set()
    for task in tasks:
        runs = await api.runs(task.id)
        first = runs[0][1]
        window = [r for r in runs if r[1] < first + timedelta(seconds=10)]
        assert 9 <= len(window) <= 11, f"{len(window)} runs in 10 s of a 1 s task"
        for (_, _, previous_end, _), (_, start, _, _) in itertools.pairwise(runs):
            assert start >= previous_end, "two runs of a blocking task overlapped"
        owners |= {r[3] for r in runs}
    assert len(owners) >= 2, f"the replicas did not share the work: {owners}"


async def test_always_failing_worker_runs_five_times_then_pauses_with_doubling_intervals(api: Api) -> None:
    task = await api.create("FAIL", repeat=True, due=now(), update_interval_ms=100)

    async def paused() -> scheduler_pb2.Task | None:
        current = await api.get(task.id)
        return current if current and current.status == scheduler_pb2.TASK_STATUS_PAUSED else None

    final = await eventually(paused, timeout=20, what="the failing task to be paused")
    assert final.failure_count == 5
    assert final.last_error == "always fails"
    assert final.pause_reason == "max_failures"
    runs = await api.runs(task.id)
    assert len(runs) == 5
    gaps = [(b[1] - a[2]).total_seconds() for a, b in itertools.pairwise(runs)]
    for gap, expected in zip(gaps, [0.2, 0.4, 0.8, 1.6], strict=True):
        assert expected * 0.9 <= gap <= expected + 0.5, (gaps, "intervals double from 100 ms")


async def test_zero_max_failures_never_pauses_and_caps_the_backoff(api: Api) -> None:
    task = await api.create(
        "FAIL", repeat=True, queue=False, update_interval_ms=100_000, max_failures=0, base_interval_ms=100_000
    )
    for _ in range(7):
        reply = await api.stub.ExecuteTask(
            scheduler_pb2.ExecuteTaskRequest(id=task.id), metadata=api.metadata, timeout=10
        )
        assert reply.run.outcome == scheduler_pb2.TASK_OUTCOME_FAILED
        assert reply.run.error == "always fails"
    current = await api.get(task.id)
    assert current is not None
    assert current.status == scheduler_pb2.TASK_STATUS_ACTIVE
    assert current.failure_count == 7
    assert current.metadata.update_interval_ms == 300_000
    until_next = current.next_run_at.ToDatetime(tzinfo=UTC) - now()
    assert timedelta(seconds=290) < until_next <= timedelta(seconds=300)


async def test_one_shot_failure_is_kept_failed_and_not_retried(api: Api) -> None:
    failing = await api.create("FAIL")

    async def failed() -> scheduler_pb2.Task | None:
        current = await api.get(failing.id)
        return current if current and current.status == scheduler_pb2.TASK_STATUS_FAILED else None

    final = await eventually(failed, timeout=10, what="the one-shot to fail")
    assert (final.last_error, final.failure_count, final.run_count) == ("always fails", 1, 1)
    # A task created later runs and is gone; the failed one still ran once.
    later = await api.create("RECORD")

    async def later_done() -> bool:
        return await api.get(later.id) is None and await api.count(later.id) == 1

    await eventually(later_done, timeout=10, what="a later one-shot to run and be deleted")
    assert await api.count(failing.id) == 1


async def test_pause_stops_runs_and_resume_now_runs_at_once(api: Api) -> None:
    ticking = await api.create("RECORD", repeat=True, due=now(), update_interval_ms=200)

    async def ran_twice() -> bool:
        return await api.count(ticking.id) >= 2

    await eventually(ran_twice, timeout=10, what="two runs")
    await api.stub.PauseTask(scheduler_pb2.PauseTaskRequest(id=ticking.id), metadata=api.metadata)

    async def idle() -> bool:
        reply = await api.stub.GetTaskStatus(
            scheduler_pb2.GetTaskStatusRequest(id=ticking.id), metadata=api.metadata
        )
        return reply.paused and not reply.executing

    await eventually(idle, timeout=10, what="the paused task to be idle")
    frozen = await api.count(ticking.id)
    witness = await api.create("RECORD", repeat=True, due=now(), update_interval_ms=200)

    async def witness_ran() -> bool:
        return await api.count(witness.id) >= 5

    await eventually(witness_ran, timeout=10, what="another task to run five times meanwhile")
    assert await api.count(ticking.id) == frozen

    hourly = await api.create("RECORD", repeat=True, due=now(), update_interval_ms=3_600_000)

    async def ran_once() -> bool:
        return await api.count(hourly.id) == 1

    await eventually(ran_once, timeout=10, what="the hourly task's first run")
    await api.stub.PauseTask(scheduler_pb2.PauseTaskRequest(id=hourly.id), metadata=api.metadata)
    resumed = await api.stub.ResumeTask(
        scheduler_pb2.ResumeTaskRequest(id=hourly.id, run_immediately=True), metadata=api.metadata
    )
    assert resumed.task.status == scheduler_pb2.TASK_STATUS_ACTIVE
    started = time.monotonic()

    async def ran_again() -> bool:
        return await api.count(hourly.id) == 2

    await eventually(ran_again, timeout=5, what="ResumeTask(run_immediately) to run it")
    assert time.monotonic() - started < 2


async def test_orphaned_task_is_paused_then_resumes_when_its_worker_registers(
    sched: SchedulerSuite, api: Api
) -> None:
    task = await api.create("LATE", repeat=True, due=now(), update_interval_ms=200)
    one_shot = await api.create("LATE")

    async def orphaned() -> bool:
        current = await api.get(task.id)
        return current is not None and current.orphaned_no_worker

    await eventually(orphaned, timeout=10, what="the repeat task to be orphaned")
    current = await api.get(task.id)
    assert current is not None
    assert (current.status, current.pause_reason) == (scheduler_pb2.TASK_STATUS_PAUSED, "no_worker")

    async def one_shot_failed() -> scheduler_pb2.Task | None:
        # Its own claim may come a moment after the repeat task's: wait for it too.
        found = await api.get(one_shot.id)
        return found if found is not None and found.status == scheduler_pb2.TASK_STATUS_FAILED else None

    failed = await eventually(one_shot_failed, timeout=10, what="the one-shot to fail for want of a worker")
    assert "no worker serves 'LATE'" in failed.last_error

    late = sched.worker("LATE")
    try:
        await late.wait_ready()

        async def resumed_and_ran() -> bool:
            current = await api.get(task.id)
            return (
                current is not None
                and not current.orphaned_no_worker
                and current.status != scheduler_pb2.TASK_STATUS_PAUSED
                and await api.count(task.id) >= 2
            )

        await eventually(resumed_and_ran, timeout=10, what="the orphan to resume and run")
    finally:
        await api.stub.DeleteTask(scheduler_pb2.DeleteTaskRequest(id=task.id), metadata=api.metadata)
        late.stop()
        sched.workers.remove(late)


async def test_long_run_keeps_its_lease_by_heartbeat(api: Api) -> None:
    task = await api.create("RECORD", values={"sleep_ms": 3500})  # the lease is 2 s

    async def done() -> bool:
        return await api.get(task.id) is None

    await eventually(done, timeout=15, what="the long run to complete")
    runs = await api.runs(task.id)
    assert [r[0] for r in runs] == [1], "one attempt, never taken over"


async def test_worker_adapts_the_interval_and_an_invalid_one_is_reported(api: Api) -> None:
    good = await api.create(
        "ADAPT", repeat=True, queue=False, update_interval_ms=60_000, values={"next_interval_ms": 250}
    )
    bad = await api.create(
        "ADAPT", repeat=True, queue=False, update_interval_ms=60_000, values={"next_interval_ms": -5}
    )
    for task in (good, bad):
        reply = await api.stub.ExecuteTask(
            scheduler_pb2.ExecuteTaskRequest(id=task.id), metadata=api.metadata, timeout=10
        )
        assert reply.run.outcome == scheduler_pb2.TASK_OUTCOME_SUCCEEDED
    adapted = await api.get(good.id)
    assert adapted is not None
    assert adapted.metadata.update_interval_ms == 250
    assert not adapted.metadata.HasField("base_interval_ms")
    kept = await api.get(bad.id)
    assert kept is not None
    assert kept.metadata.update_interval_ms == 60_000
    assert kept.last_error.startswith("TASK_ADAPTIVE_INTERVAL_INVALID")


async def test_missed_runs_skip_or_catch_up_once(api: Api) -> None:
    long_ago = now() - timedelta(seconds=30)
    skipping = await api.create(
        "RECORD", repeat=True, due=long_ago, update_interval_ms=2000, missed_run=scheduler_pb2.MISSED_RUN_SKIP
    )
    catching_up = await api.create("RECORD", repeat=True, due=long_ago, update_interval_ms=60_000)

    async def both_handled() -> bool:
        skipped = await api.get(skipping.id)
        return (
            skipped is not None
            and skipped.next_run_at.ToDatetime(tzinfo=UTC) > now()
            and await api.count(catching_up.id) == 1
        )

    await eventually(both_handled, timeout=10, what="the missed slots handled")
    assert await api.count(skipping.id) == 0, "a skipped slot does not run"
    current = await api.get(skipping.id)
    assert current is not None
    assert current.run_count == 0

    async def next_slot_ran() -> bool:
        return await api.count(skipping.id) == 1

    await eventually(next_slot_ran, timeout=10, what="the skipping task to run at its next slot")


async def test_cron_task_runs_on_demand_and_is_scheduled_on_the_next_firing(api: Api) -> None:
    task = await api.create("RECORD", repeat=True, cron="*/5 * * * *")
    first = task.next_run_at.ToDatetime(tzinfo=UTC)
    assert first.minute % 5 == 0
    assert first.second == 0
    assert first > now()
    reply = await api.stub.ExecuteTask(scheduler_pb2.ExecuteTaskRequest(id=task.id), metadata=api.metadata)
    assert reply.run.outcome == scheduler_pb2.TASK_OUTCOME_SUCCEEDED
    after = await api.get(task.id)
    assert after is not None
    assert after.next_run_at.ToDatetime(tzinfo=UTC) == first
    assert after.run_count == 1


async def test_bad_input_is_a_clear_invalid_argument_over_grpc_and_nats(
    sched: SchedulerSuite, api: Api
) -> None:
    bad = scheduler_pb2.TaskSpec(
        agent_id=api.agent,
        name="RECORD",
        tags=["queue", "repeat"],
        metadata=scheduler_pb2.TaskMetadata(update_interval_ms=float("nan")),
    )
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await api.stub.CreateTask(scheduler_pb2.CreateTaskRequest(task=bad), metadata=api.metadata)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "TASK_SCHEDULE_INVALID" in (caught.value.details() or "")
    assert "metadata.update_interval_ms" in (caught.value.details() or "")

    secret = "sk-live-" + secrets.token_hex(8)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await api.stub.CreateTask(
            scheduler_pb2.CreateTaskRequest(
                task=scheduler_pb2.TaskSpec(agent_id=secret, name="RECORD", tags=["queue"])
            ),
            metadata=api.metadata,
        )
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert secret not in (caught.value.details() or "")

    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await api.stub.ListTasks(
            scheduler_pb2.ListTasksRequest(), metadata=[("authorization", "Bearer nope")]
        )
    assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED

    bus = await Bus.connect(sched.env.nats_url, name="e2e", namespace=sched.namespace)
    try:
        rpc = RpcClient(bus)
        batch = scheduler_pb2.CreateTasksRequest(
            tasks=[scheduler_pb2.TaskSpec(agent_id=api.agent, name="RECORD"), bad]
        )
        with pytest.raises(InvalidArgument) as over_nats:
            await rpc.call("scheduler", "CreateTasks", batch, scheduler_pb2.CreateTasksResponse)
        assert over_nats.value.code == "TASK_SCHEDULE_INVALID"
        assert over_nats.value.message.startswith("tasks[1].metadata.update_interval_ms")
        with pytest.raises(NotFound):
            await rpc.call(
                "scheduler",
                "GetTask",
                scheduler_pb2.GetTaskRequest(id=str(uuid.uuid4())),
                scheduler_pb2.GetTaskResponse,
            )
        status = await rpc.call(
            "scheduler",
            "GetTaskStatus",
            scheduler_pb2.GetTaskStatusRequest(id=str(uuid.uuid4())),
            scheduler_pb2.GetTaskStatusResponse,
        )
        assert (status.HasField("task"), status.paused, status.executing) == (False, False, False)
        # Garbage on the wire: an error reply, and the service keeps serving.
        garbage = frames.request(b"\xff\xfe\x00", deadline=None)
        reply = await bus.nc.request(f"{sched.namespace}.scheduler.CreateTask", garbage, timeout=5)
        assert frames.parse_reply(reply.data)[0] == frames.ERROR
        listed = await rpc.call(
            "scheduler",
            "ListTasks",
            scheduler_pb2.ListTasksRequest(agent_id=api.agent),
            scheduler_pb2.ListTasksResponse,
        )
        assert list(listed.tasks) == [], "nothing of the refused batch was created"
    finally:
        await bus.close()


async def test_a_garbled_worker_reply_is_a_failure_and_the_scheduler_carries_on(
    sched: SchedulerSuite, api: Api
) -> None:
    bus = await Bus.connect(sched.env.nats_url, name="rogue", namespace=sched.namespace)
    try:

        async def garble(msg: Any) -> None:
            await bus.nc.publish(msg.reply, b"\xff\xfe not protobuf", headers={"Parley-Status": "ok"})

        await bus.nc.subscribe(f"{sched.namespace}.tasks.run.ROGUE", queue="tasks", cb=garble)
        await bus.nc.flush()
        task = await api.create("ROGUE", queue=False)
        reply = await api.stub.ExecuteTask(
            scheduler_pb2.ExecuteTaskRequest(id=task.id), metadata=api.metadata
        )
        assert reply.run.outcome == scheduler_pb2.TASK_OUTCOME_FAILED
        assert "does not decode" in reply.run.error
        failed = await api.get(task.id)
        assert failed is not None
        assert failed.status == scheduler_pb2.TASK_STATUS_FAILED
        healthy = await api.create("RECORD")

        async def ran() -> bool:
            return await api.count(healthy.id) == 1

        await eventually(ran, timeout=10, what="the scheduler to go on running tasks")
    finally:
        await bus.close()


async def test_list_update_and_delete(api: Api) -> None:
    created = [
        await api.create("RECORD", repeat=True, queue=False, update_interval_ms=60_000) for _ in range(3)
    ]
    paused = created[0]
    await api.stub.PauseTask(scheduler_pb2.PauseTaskRequest(id=paused.id), metadata=api.metadata)
    listed = await api.stub.ListTasks(
        scheduler_pb2.ListTasksRequest(
            agent_id=api.agent, tags=["repeat"], page=common_pb2.PageRequest(limit=2)
        ),
        metadata=api.metadata,
    )
    assert [t.id for t in listed.tasks] == [t.id for t in created[:2]]
    assert listed.page.has_more
    only_paused = await api.stub.ListTasks(
        scheduler_pb2.ListTasksRequest(agent_id=api.agent, status=scheduler_pb2.TASK_STATUS_PAUSED),
        metadata=api.metadata,
    )
    assert [t.id for t in only_paused.tasks] == [paused.id]

    task = created[1]
    updated = await api.stub.UpdateTask(
        scheduler_pb2.UpdateTaskRequest(
            id=task.id,
            task=scheduler_pb2.TaskSpec(
                description="now every 5 s", metadata=scheduler_pb2.TaskMetadata(update_interval_ms=5000)
            ),
            update_mask=FieldMask(paths=["description", "metadata.update_interval_ms"]),
            expected_revision=task.revision,
        ),
        metadata=api.metadata,
    )
    assert updated.task.description == "now every 5 s"
    assert updated.task.metadata.update_interval_ms == 5000
    assert updated.task.revision == task.revision + 1
    with pytest.raises(grpc.aio.AioRpcError) as stale:
        await api.stub.UpdateTask(
            scheduler_pb2.UpdateTaskRequest(
                id=task.id,
                task=scheduler_pb2.TaskSpec(description="lost update"),
                update_mask=FieldMask(paths=["description"]),
                expected_revision=task.revision,
            ),
            metadata=api.metadata,
        )
    assert stale.value.code() == grpc.StatusCode.ABORTED
    with pytest.raises(grpc.aio.AioRpcError) as invalid:
        await api.stub.UpdateTask(
            scheduler_pb2.UpdateTaskRequest(
                id=task.id,
                task=scheduler_pb2.TaskSpec(metadata=scheduler_pb2.TaskMetadata(cron="every day")),
                update_mask=FieldMask(paths=["metadata.cron", "metadata.update_interval_ms"]),
            ),
            metadata=api.metadata,
        )
    assert invalid.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "metadata.cron" in (invalid.value.details() or "")

    # Racing updates from the same revision: exactly one wins, the others are told to re-read.
    current = updated.task.revision

    async def update(index: int) -> bool:
        try:
            await api.stub.UpdateTask(
                scheduler_pb2.UpdateTaskRequest(
                    id=task.id,
                    task=scheduler_pb2.TaskSpec(description=f"writer {index}"),
                    update_mask=FieldMask(paths=["description"]),
                    expected_revision=current,
                ),
                metadata=api.metadata,
            )
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.ABORTED:
                raise
            return False
        return True

    results = await asyncio.gather(*(update(i) for i in range(8)))
    assert results.count(True) == 1
    final = await api.get(task.id)
    assert final is not None
    assert final.revision == current + 1
    assert final.description == f"writer {results.index(True)}"

    deleted = await api.stub.DeleteTask(scheduler_pb2.DeleteTaskRequest(id=task.id), metadata=api.metadata)
    assert deleted.task.id == task.id
    with pytest.raises(grpc.aio.AioRpcError) as gone:
        await api.stub.GetTask(scheduler_pb2.GetTaskRequest(id=task.id), metadata=api.metadata)
    assert gone.value.code() == grpc.StatusCode.NOT_FOUND
    other_agent = await api.stub.GetTask(
        scheduler_pb2.GetTaskRequest(id=created[2].id, agent_id=api.agent), metadata=api.metadata
    )
    assert other_agent.task.id == created[2].id
    with pytest.raises(grpc.aio.AioRpcError) as isolated:
        await api.stub.GetTask(
            scheduler_pb2.GetTaskRequest(id=created[2].id, agent_id=str(uuid.uuid4())), metadata=api.metadata
        )
    assert isolated.value.code() == grpc.StatusCode.NOT_FOUND, "another agent's task is invisible"


async def test_cli_manages_tasks(
    sched: SchedulerSuite, api: Api, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    env = {
        "PARLEY_SCHEDULER_ADDR": f"127.0.0.1:{sched.schedulers[0].grpc_port}",
        "PARLEY_OPERATOR_TOKEN": sched.env.token,
        "PARLEY_STATE_DIR": str(sched.logs / "cli-state"),
    }
    # Once through the installed `parley` executable...
    proc = await asyncio.create_subprocess_exec(
        str(Path(sys.executable).parent / "parley"),
        *("tasks", "create", "RECORD", "--agent", api.agent, "--repeat", "--interval", "1h"),
        *("--due", "+1h", "--values", '{"a": 1}'),
        env={**os.environ, **env},
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out_bytes, err_bytes = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode == 0, err_bytes.decode()
    task_id = re.search(r"created ([0-9a-f-]{36})", out_bytes.decode()).group(1)  # type: ignore[union-attr]

    # ...and then in this process (the same code, without paying for a start-up per command).
    for key, value in env.items():
        monkeypatch.setenv(key, value)

    async def cli(*args: str) -> tuple[int, str, str]:
        code = await asyncio.to_thread(cli_main, ["tasks", *args])
        captured = capsys.readouterr()
        return code, captured.out, captured.err

    code, out, _ = await cli("list", "--agent", api.agent)
    assert code == 0
    assert task_id in out
    assert "every 3600s" in out
    code, out, _ = await cli("show", task_id)
    assert code == 0
    assert '"a": 1' in out
    assert "status:      active" in out
    code, out, _ = await cli("pause", task_id)
    assert code == 0
    assert "paused (operator)" in out
    code, out, _ = await cli("resume", task_id)
    assert code == 0
    assert "active" in out
    code, out, _ = await cli("run", task_id)
    assert code == 0, out
    assert "succeeded  attempt 1" in out
    assert await api.count(task_id) == 1
    code, out, _ = await cli("delete", task_id)
    assert code == 0
    assert f"deleted {task_id}" in out
    code, _, err = await cli("show", task_id)
    assert code == 1
    assert "no task" in err
    code, _, err = await cli("create", "RECORD", "--agent", api.agent, "--repeat")
    assert code == 1
    assert "metadata.update_interval_ms" in err
    code, _, err = await cli("create", "RECORD", "--agent", api.agent, "--interval", "soon")
    assert code == 1
    assert "--interval" in err


def scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as response:
        return str(response.read().decode())


async def test_metrics_of_the_replicas(sched: SchedulerSuite, api: Api) -> None:
    task = await api.create("RECORD")
    failing = await api.create("FAIL", repeat=True, due=now(), update_interval_ms=100, max_failures=1)

    async def done() -> bool:
        paused = await api.get(failing.id)
        return await api.get(task.id) is None and paused is not None and paused.pause_reason == "max_failures"

    await eventually(done, timeout=10, what="a run and a pause")
    totals: dict[str, float] = {}
    for scheduler in sched.schedulers:
        port = scheduler.env["PARLEY_SCHEDULER_METRICS_PORT"]
        text = await asyncio.to_thread(scrape, f"http://127.0.0.1:{port}/metrics")
        for name, value in re.findall(r"^([a-z_]+(?:\{[^}]*\})?) ([0-9.e+-]+)$", text, re.M):
            totals[name] = totals.get(name, 0.0) + float(value)
    assert totals['parley_tasks_executed_total{outcome="succeeded",worker="RECORD"}'] >= 1
    assert totals["parley_task_lag_seconds_count"] >= 1
    assert totals['parley_task_duration_seconds_count{worker="RECORD"}'] >= 1
    assert "parley_tasks_due" in totals
    assert "parley_task_claim_conflicts_total" in totals
    assert "parley_task_lease_expired_total" in totals
    assert totals.get('parley_tasks_paused_total{reason="max_failures"}', 0) >= 1


async def test_serverless_mode_runs_due_tasks_only_when_asked(
    test_env: SessionEnv, tmp_path_factory: pytest.TempPathFactory
) -> None:
    name = f"parley_serverless_{secrets.token_hex(4)}"
    url = create_database(test_env.server_database_url, name)
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(RUNS_TABLE)
    suite = SchedulerSuite(test_env, url, f"v{secrets.token_hex(4)}", tmp_path_factory.mktemp("serverless"))
    try:
        await suite.start(schedulers=1, workers=1, PARLEY_SCHEDULER_MODE="serverless")
        channel, stub = suite.stub()
        api = Api(stub, suite.metadata, str(uuid.uuid4()), url)
        try:
            tasks = [await api.create("RECORD") for _ in range(5)]
            later = await api.create("RECORD", due=now() + timedelta(hours=1))
            listed = await stub.ListTasks(scheduler_pb2.ListTasksRequest(), metadata=suite.metadata)
            assert len(listed.tasks) == 6
            assert [await api.count(t.id) for t in tasks] == [0] * 5, "nothing runs unasked"
            reply = await stub.RunDueTasks(
                scheduler_pb2.RunDueTasksRequest(limit=10), metadata=suite.metadata
            )
            assert sorted(r.task_id for r in reply.runs) == sorted(t.id for t in tasks)
            assert {(r.outcome, r.deleted, r.attempt) for r in reply.runs} == {
                (scheduler_pb2.TASK_OUTCOME_SUCCEEDED, True, 1)
            }
            assert [await api.count(t.id) for t in tasks] == [1] * 5
            again = await stub.RunDueTasks(scheduler_pb2.RunDueTasksRequest(), metadata=suite.metadata)
            assert list(again.runs) == []
            assert await api.get(later.id) is not None
        finally:
            await channel.close()
    finally:
        suite.stop()
        drop_database(test_env.server_database_url, name)


# --- non-blocking repeat tasks ---------------------------------------------------------------------


@dataclass(frozen=True)
class Run:
    attempt: int
    started: datetime
    finished: datetime
    token: int
    slot: datetime | None
    owner: str


async def leased_runs(database_url: str, task_id: str) -> list[Run]:
    async with await psycopg.AsyncConnection.connect(database_url) as conn:
        cur = await conn.execute(
            "SELECT attempt, started_at, finished_at, token, slot, owner FROM e2e_runs WHERE task_id = %s"
            " ORDER BY started_at",
            (task_id,),
        )
        return [Run(*row) for row in await cur.fetchall()]


def overlapping_pairs(runs: list[Run]) -> int:
    return sum(
        1 for a, b in itertools.combinations(runs, 2) if a.started < b.finished and b.started < a.finished
    )


def most_at_once(runs: list[Run]) -> int:
    return max((sum(1 for r in runs if r.started <= run.started < r.finished) for run in runs), default=0)


async def in_flight_runs(database_url: str, task_id: str) -> int:
    async with await psycopg.AsyncConnection.connect(database_url) as conn:
        cur = await conn.execute("SELECT count(*) FROM scheduler.run WHERE task_id = %s", (task_id,))
        row = await cur.fetchone()
    return int(row[0]) if row else 0


def whole_slots(slots: list[datetime], interval: timedelta) -> bool:
    return all(b > a and (b - a) % interval == timedelta(0) for a, b in itertools.pairwise(slots))


async def test_a_non_blocking_task_overlaps_itself_and_a_blocking_one_never_does(api: Api) -> None:
    # Every 300 ms, each run taking 1 s: the non-blocking task's next slots are claimed (by any of the
    # three replicas) while its earlier runs go on; the blocking task waits for each run to end.
    interval = timedelta(milliseconds=300)
    concurrent = await api.create(
        "RECORD", repeat=True, due=now(), update_interval_ms=300, blocking=False, values={"sleep_ms": 1000}
    )
    blocking = await api.create(
        "RECORD", repeat=True, due=now(), update_interval_ms=300, values={"sleep_ms": 1000}
    )
    assert (concurrent.metadata.blocking, blocking.metadata.blocking) == (False, True)

    async def overlapping() -> bool:
        return await in_flight_runs(api.database_url, concurrent.id) >= 2

    await eventually(overlapping, timeout=15, interval=0.02, what="two runs of the task in flight at once")
    status = await api.stub.GetTaskStatus(
        scheduler_pb2.GetTaskStatusRequest(id=concurrent.id), metadata=api.metadata
    )
    # The task itself holds no lease: it stays active, each run has a lease of its own.
    assert (status.task.status, status.executing) == (scheduler_pb2.TASK_STATUS_ACTIVE, True)

    async def enough() -> bool:
        return await api.count(concurrent.id) >= 12 and await api.count(blocking.id) >= 4

    await eventually(enough, timeout=40, what="a dozen runs of the non-blocking task")
    runs = await leased_runs(api.database_url, concurrent.id)
    pairs, widest = overlapping_pairs(runs), most_at_once(runs)
    assert widest >= 2, "no two runs of the non-blocking task overlapped"
    assert pairs >= len(runs) // 2, f"only {pairs} overlapping pairs in {len(runs)} runs"
    assert len({r.token for r in runs}) == len(runs), "two runs shared a lease token"
    assert {r.attempt for r in runs} == {1}
    slots = sorted(r.slot for r in runs if r.slot is not None)
    assert len(slots) == len(runs)
    assert len(set(slots)) == len(slots), "a slot was claimed twice"
    assert whole_slots(slots, interval), "the slots are not the task's cadence"

    serial = await leased_runs(api.database_url, blocking.id)
    assert overlapping_pairs(serial) == 0, "two runs of a blocking task overlapped"
    for previous, following in itertools.pairwise(serial):
        assert following.started >= previous.finished
    print(
        f"non-blocking: {len(runs)} runs, {pairs} overlapping pairs, up to {widest} at once, "
        f"{len({r.token for r in runs})} lease tokens, {len({r.owner for r in runs})} replicas; "
        f"blocking: {len(serial)} runs, 0 overlapping"
    )


async def test_failures_of_overlapping_runs_are_each_counted_and_pause_the_task(api: Api) -> None:
    # Runs fail concurrently: each failure counts (a completion is a compare-and-set against the
    # others'), the backoff applies, and the task is paused at the limit.
    task = await api.create(
        "FAIL", repeat=True, due=now(), update_interval_ms=100, blocking=False, values={"sleep_ms": 500}
    )

    async def settled() -> scheduler_pb2.GetTaskStatusResponse | None:
        reply = await api.stub.GetTaskStatus(
            scheduler_pb2.GetTaskStatusRequest(id=task.id), metadata=api.metadata
        )
        return reply if reply.paused and not reply.executing else None

    final = await eventually(settled, timeout=20, what="the failing task paused with no run in flight")
    runs = await leased_runs(api.database_url, task.id)
    assert final.task.pause_reason == "max_failures"
    assert final.task.failure_count == len(runs) >= 5, "a failure of a concurrent run was not counted"
    assert overlapping_pairs(runs) >= 1
    assert final.task.metadata.update_interval_ms == min(100 * 2 ** len(runs), 300_000)
    print(f"failing non-blocking task: {len(runs)} runs, failure_count {final.task.failure_count}, paused")


async def test_racing_claimers_take_each_slot_of_a_non_blocking_task_once(test_env: SessionEnv) -> None:
    # Twelve connections claim one non-blocking task every 20 ms in a tight loop, each setting the next
    # slot after its claim as a replica does: every slot has exactly one winner. Then the runs all fail
    # at once, racing: every failure is counted.
    name = f"parley_race_{secrets.token_hex(4)}"
    url = create_database(test_env.server_database_url, name)
    claimers, wanted, interval = 12, 60, timedelta(milliseconds=20)
    try:
        await migrate(url, SCHEMA, MIGRATIONS_DIR)
        setup = Database(url, name="race-setup", min_size=1, max_size=1)
        await setup.open()
        try:
            spec = domain.new_task(
                id="",
                agent_id=str(uuid.uuid4()),
                name="TICK",
                description="",
                tags=["queue", "repeat"],
                room_id="",
                world_id="",
                entity_id="",
                due_at=now(),
                metadata=domain.MetadataInput(update_interval_ms=20, blocking=False),
                values={},
            )
            [row] = await SchedulerStore(setup).insert([insert_row(spec, now())])
        finally:
            await setup.close()
        task_id = row.id
        won: list[tuple[int, Claimed]] = []
        stores = [
            SchedulerStore(Database(url, name=f"claimer-{i}", min_size=1, max_size=1))
            for i in range(claimers)
        ]
        for store in stores:
            await store.db.open()

        async def claimer(index: int) -> None:
            store = stores[index]
            while len(won) < wanted:
                for claimed in await store.claim_due(f"replica-{index}", 60_000, 4):
                    assert claimed.concurrent
                    assert claimed.slot is not None
                    assert claimed.attempt == 1
                    won.append((index, claimed))
                    following, ready = rules.slot_after_claim(claimed.state, claimed.db_now)
                    assert await store.advance_slot(claimed.id, claimed.slot, following, ready)

        async def fail(index: int, claimed: Claimed) -> int:
            store, state, tries = stores[index], claimed.state, 1
            while True:
                outcome = rules.on_failure(state, claimed.db_now, error="boom", retry_at=None)
                applied, held = await store.finish_run(
                    run_completion_row(claimed, state, rules.for_concurrent_run(outcome))
                )
                if applied:
                    return tries
                assert held, "a run lost its lease"
                current = await store.get(claimed.id, None)
                assert current is not None
                state, tries = current.state, tries + 1

        try:
            await asyncio.wait_for(asyncio.gather(*(claimer(i) for i in range(claimers))), 60)
            per_slot = Counter(claimed.slot for _, claimed in won)
            assert set(per_slot.values()) == {1}, "a slot had two winners"
            winners = Counter(index for index, _ in won)
            assert len(winners) > 1, "one claimer won every slot; the race did not happen"
            assert whole_slots(sorted(per_slot), interval)  # type: ignore[type-var]
            assert len({claimed.token for _, claimed in won}) == len(won)
            assert await in_flight_runs(url, str(task_id)) == len(won)
            tries = await asyncio.wait_for(asyncio.gather(*(fail(i, c) for i, c in won)), 60)
        finally:
            for store in stores:
                await store.db.close()
        async with await psycopg.AsyncConnection.connect(url) as conn:
            cur = await conn.execute(
                "SELECT failure_count, status, pause_reason FROM scheduler.task WHERE id = %s", (task_id,)
            )
            assert await cur.fetchone() == (len(won), "paused", "max_failures")
        assert await in_flight_runs(url, str(task_id)) == 0
        print(
            f"{len(won)} slots claimed by {claimers} racing connections: one winner each "
            f"({dict(winners)} wins per claimer); {len(won)} racing failures all counted, "
            f"{sum(tries) - len(tries)} compare-and-set retries"
        )
    finally:
        drop_database(test_env.server_database_url, name)


async def test_a_killed_non_blocking_run_is_taken_over_as_the_next_attempt(
    sched: SchedulerSuite, api: Api
) -> None:
    hanging = sched.worker("HANG", E2E_HANG="1")
    healthy: WorkerProcess | None = None
    try:
        await hanging.wait_ready()
        task = await api.create("HANG", repeat=True, due=now(), update_interval_ms=3_600_000, blocking=False)

        async def hangs() -> bool:
            return f"hanging {task.id} 1" in hanging.log_path.read_text(errors="replace")

        await eventually(hangs, timeout=10, what="the first attempt to start")
        async with await psycopg.AsyncConnection.connect(api.database_url) as conn:
            cur = await conn.execute(
                "SELECT r.attempt, r.lease_token, t.status, t.lease_owner,"
                " t.next_run_at > now() + interval '59 min'"
                " FROM scheduler.run r JOIN scheduler.task t ON t.id = r.task_id WHERE r.task_id = %s",
                (task.id,),
            )
            [(attempt, first_token, status, task_owner, moved_on)] = await cur.fetchall()
        assert (attempt, status, task_owner, moved_on) == (1, "active", None, True)
        healthy = sched.worker("HANG")
        await healthy.wait_ready()
        hanging.kill()

        async def taken_over() -> list[Run]:
            return [r for r in await leased_runs(api.database_url, task.id) if r.attempt == 2]

        [second] = await eventually(taken_over, timeout=20, what="the run taken over as attempt 2")
        assert second.token != first_token
        assert [r.attempt for r in await leased_runs(api.database_url, task.id)] == [2]
        async with await psycopg.AsyncConnection.connect(api.database_url) as conn:
            cur = await conn.execute(
                "SELECT attempt, lease_token FROM scheduler.uncertain_attempt WHERE task_id = %s", (task.id,)
            )
            assert await cur.fetchall() == [(1, first_token)]
        status_reply = await api.stub.GetTaskStatus(
            scheduler_pb2.GetTaskStatusRequest(id=task.id), metadata=api.metadata
        )
        assert [u.attempt for u in status_reply.uncertain_attempts] == [1]

        async def done() -> bool:
            return await in_flight_runs(api.database_url, task.id) == 0

        await eventually(done, timeout=10, what="the second attempt to complete")
        current = await api.get(task.id)
        assert current is not None
        assert (current.status, current.run_count, current.failure_count) == (
            scheduler_pb2.TASK_STATUS_ACTIVE,
            1,
            0,
        )
        # ExecuteTask runs it at once beside its schedule: a run of its own, whose success leaves the
        # next slot where the claim put it.
        reply = await api.stub.ExecuteTask(
            scheduler_pb2.ExecuteTaskRequest(id=task.id), metadata=api.metadata, timeout=10
        )
        assert (reply.run.outcome, reply.run.attempt) == (scheduler_pb2.TASK_OUTCOME_SUCCEEDED, 1)
        after = await api.get(task.id)
        assert after is not None
        assert after.run_count == 2
        assert after.next_run_at == current.next_run_at
    finally:
        for process in (hanging, healthy):
            if process is not None:
                process.stop()
                sched.workers.remove(process)


# --- exactly one claim per slot --------------------------------------------------------------------

TEN_THOUSAND = 10_000


async def create_many(
    api: Api, count: int, marker: str, due: datetime | None = None, sleep_ms: int = 0
) -> list[str]:
    ids: list[str] = []
    for start in range(0, count, 1000):
        batch = scheduler_pb2.CreateTasksRequest(
            tasks=[
                scheduler_pb2.TaskSpec(agent_id=api.agent, name="RECORD", tags=["queue"])
                for _ in range(min(1000, count - start))
            ]
        )
        for spec in batch.tasks:
            spec.metadata.values.update({"run": marker, "sleep_ms": sleep_ms})
            if due is not None:
                spec.due_at.FromDatetime(due)
        reply = await api.stub.CreateTasks(batch, metadata=api.metadata, timeout=30)
        ids += list(reply.ids)
    return ids


async def runs_of(database_url: str, marker: str) -> list[tuple[str, int]]:
    async with await psycopg.AsyncConnection.connect(database_url) as conn:
        cur = await conn.execute("SELECT task_id::text, attempt FROM e2e_runs WHERE marker = %s", (marker,))
        return list(await cur.fetchall())


async def count_runs(database_url: str, marker: str) -> int:
    async with await psycopg.AsyncConnection.connect(database_url) as conn:
        cur = await conn.execute("SELECT count(*) FROM e2e_runs WHERE marker = %s", (marker,))
        row = await cur.fetchone()
        assert row is not None
        return int(row[0])


async def remaining(database_url: str, agent: str) -> int:
    async with await psycopg.AsyncConnection.connect(database_url) as conn:
        cur = await conn.execute("SELECT count(*) FROM scheduler.task WHERE agent_id = %s", (agent,))
        row = await cur.fetchone()
        assert row is not None
        return int(row[0])


async def test_ten_thousand_one_shots_run_exactly_once_with_three_replicas(
    sched: SchedulerSuite, api: Api
) -> None:
    extra = [sched.worker() for _ in range(4 - len(sched.workers))]
    await asyncio.gather(*(w.wait_ready() for w in extra))
    assert len(sched.schedulers) == 3
    assert len(sched.workers) == 4
    started = time.monotonic()
    ids = await create_many(api, TEN_THOUSAND, "exactly-once")

    async def all_done() -> bool:
        return await remaining(api.database_url, api.agent) == 0

    await eventually(all_done, timeout=60, interval=0.2, what="10,000 tasks to run")
    took = time.monotonic() - started
    runs = await runs_of(api.database_url, "exactly-once")
    per_task = {}
    for task_id, attempt in runs:
        per_task[task_id] = per_task.get(task_id, 0) + 1
        assert attempt == 1
    assert set(per_task) == set(ids), "a task was lost"
    assert set(per_task.values()) == {1}, "a task ran twice"
    async with await psycopg.AsyncConnection.connect(api.database_url) as conn:
        cur = await conn.execute(
            "SELECT count(DISTINCT owner), count(DISTINCT pid) FROM e2e_runs WHERE marker = 'exactly-once'"
        )
        replicas, workers = await cur.fetchone()  # type: ignore[misc]
    assert (replicas, workers) == (3, 4), "every replica claimed and every worker ran some"
    print(f"10,000 one-shots, 3 replicas, 4 workers: {took:.1f} s ({TEN_THOUSAND / took:.0f} tasks/s)")


async def test_ten_thousand_one_shots_survive_sigkill_of_a_scheduler_and_a_worker(
    sched: SchedulerSuite, api: Api
) -> None:
    # Created for later, then all made due at one moment by one statement (whose NOTIFY wakes the
    # replicas): the kills must land while runs are in flight, not while tasks are being created. Each
    # run takes 50 ms, so a lease seen in the database belongs to a run that is still under way.
    ids = await create_many(api, TEN_THOUSAND, "crash", due=now() + timedelta(hours=1), sleep_ms=50)
    async with await psycopg.AsyncConnection.connect(api.database_url, autocommit=True) as conn:
        await conn.execute(
            "UPDATE scheduler.task SET next_run_at = now(), ready_at = now() WHERE agent_id = %s",
            (api.agent,),
        )
    started = time.monotonic()

    async def under_way() -> bool:
        return await count_runs(api.database_url, "crash") >= 1500

    await eventually(under_way, timeout=30, interval=0.01, what="the tasks to be under way")

    async def leases_of(pid: int) -> int:
        # Replica names end in -<pid>-<hex>.
        async with await psycopg.AsyncConnection.connect(api.database_url) as conn:
            cur = await conn.execute(
                "SELECT count(*) FROM scheduler.task WHERE lease_owner LIKE %s", (f"%-{pid}-%",)
            )
            row = await cur.fetchone()
        return int(row[0]) if row else 0

    # Kill a scheduler while it holds runs in flight, so the crash path is exercised however the load
    # on the machine shifted the timing. Its leases must still be in the database after the kill (a
    # completion in flight at the kill may have released them all); if none are, the next replica
    # is the victim (one of the three is always left).
    victim_worker = sched.workers[0]
    orphaned = 0
    for victim in sched.schedulers[:2]:
        await eventually(
            functools.partial(leases_of, victim.pid), timeout=30, interval=0.005, what="the victim's leases"
        )
        victim.kill()
        if victim is sched.schedulers[0]:
            victim_worker.kill()
        orphaned = await leases_of(victim.pid)
        if orphaned:
            break
    assert orphaned, "neither killed replica left a lease behind"
    print("leases orphaned by the kill:", orphaned, "remaining", await remaining(api.database_url, api.agent))

    async def all_done() -> bool:
        return await remaining(api.database_url, api.agent) == 0

    await eventually(all_done, timeout=60, interval=0.2, what="every task to complete after the kills")
    took = time.monotonic() - started
    runs = await runs_of(api.database_url, "crash")
    attempts: dict[str, list[int]] = {}
    for task_id, attempt in runs:
        attempts.setdefault(task_id, []).append(attempt)
    assert set(attempts) == set(ids), f"{len(set(ids) - set(attempts))} tasks were lost"
    for task_id, seen in attempts.items():
        assert len(seen) == len(set(seen)), f"{task_id} ran twice as the same attempt: {seen}"
    async with await psycopg.AsyncConnection.connect(api.database_url) as conn:
        cur = await conn.execute(
            "SELECT task_id::text, attempt FROM scheduler.uncertain_attempt WHERE agent_id = %s", (api.agent,)
        )
        uncertain = {(task_id, attempt) for task_id, attempt in await cur.fetchall()}
    assert uncertain, "the kills interrupted no run; the crash path was not exercised"
    rerun = {task_id for task_id, seen in attempts.items() if max(seen) > 1}
    assert rerun, "no task was run again after the kills"
    for task_id in rerun:
        # Every re-run is the attempt after an uncertain one the scheduler recorded.
        for attempt in attempts[task_id]:
            if attempt > 1:
                assert (task_id, attempt - 1) in uncertain, (task_id, attempts[task_id])
    assert {task_id for task_id, _ in uncertain} <= set(ids)
    assert max(max(seen) for seen in attempts.values()) >= 2
    print(
        f"10,000 one-shots with SIGKILL: {took:.1f} s; {len(uncertain)} uncertain attempts, "
        f"{len(rerun)} tasks run again as attempt 2+"
    )
