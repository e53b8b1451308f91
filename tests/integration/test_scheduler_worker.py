"""The worker library over a real NATS server: handlers by name in a queue group, results and
failures, probes, heartbeats that keep a lease, and a lost lease that cancels the run."""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta

import nats.errors
import pytest
from google.protobuf.timestamp_pb2 import Timestamp
from nats.aio.msg import Msg

from parley.v1 import common_pb2, scheduler_pb2
from parley_platform.bus import Bus
from parley_platform.errors import InvalidArgument
from parley_platform.permissions import MAX_BATCH_RUNS
from parley_platform.worker import (
    BATCH_HEADER,
    PROBE_HEADER,
    STATUS,
    Lease,
    Task,
    TaskFailed,
    TaskResult,
    WorkerHost,
    Workers,
    run_subject,
)
from support import SessionEnv


@pytest.fixture
async def worker_bus(test_env: SessionEnv) -> AsyncIterator[Bus]:
    bus = await Bus.connect(test_env.nats_url, name="worker-test", namespace=f"w{secrets.token_hex(4)}")
    yield bus
    await bus.close()


def request(name: str, *, lease_ms: float = 0, heartbeat: str = "", deadline_s: float = 30) -> bytes:
    message = scheduler_pb2.RunTaskRequest(
        task=scheduler_pb2.Task(id="t-1", agent_id="a-1", name=name, tags=["queue"]),
        heartbeat_subject=heartbeat,
        lease_ms=lease_ms,
    )
    message.task.metadata.values.update({"greeting": "hi", "n": 3})
    message.lease.token, message.lease.attempt, message.lease.owner = 7, 2, "replica-1"
    deadline = Timestamp()
    deadline.FromDatetime(datetime.now(UTC) + timedelta(seconds=deadline_s))
    message.lease.deadline.CopyFrom(deadline)
    return message.SerializeToString()


def response(reply: Msg) -> scheduler_pb2.RunTaskResponse:
    assert (reply.headers or {}).get(STATUS) == "ok"
    return scheduler_pb2.RunTaskResponse.FromString(reply.data)


async def test_handlers_get_task_and_lease_and_report_results(worker_bus: Bus) -> None:
    seen: list[tuple[Task, Lease]] = []
    workers = Workers()

    @workers.worker("ADAPT")
    async def adapt(task: Task, lease: Lease) -> TaskResult:
        seen.append((task, lease))
        return TaskResult(next_interval_ms=250, preserve=True)

    @workers.worker("PLAIN")
    async def plain(task: Task, lease: Lease) -> None:
        return None

    @workers.worker("FAILS")
    async def fails(task: Task, lease: Lease) -> None:
        raise TaskFailed("upstream down", retry_at=datetime(2030, 1, 1, tzinfo=UTC))

    @workers.worker("CRASHES")
    async def crashes(task: Task, lease: Lease) -> None:
        raise KeyError("missing")

    @workers.worker("SLOW")
    async def slow(task: Task, lease: Lease) -> None:
        await asyncio.Event().wait()

    host = WorkerHost(worker_bus, service="test", workers=workers)
    await host.start()
    try:
        nc, subjects = worker_bus.nc, worker_bus.subjects
        adapted = response(await nc.request(run_subject(subjects, "ADAPT"), request("ADAPT"), timeout=5))
        assert adapted.next_interval_ms == 250
        assert adapted.preserve
        assert not adapted.failed
        [(task, lease)] = seen
        assert (task.id, task.agent_id, task.name, task.tags, task.values) == (
            "t-1",
            "a-1",
            "ADAPT",
            ("queue",),
            {"greeting": "hi", "n": 3},
        )
        assert (lease.token, lease.attempt, lease.owner, lease.lost) == (7, 2, "replica-1", False)

        plain_reply = response(await nc.request(run_subject(subjects, "PLAIN"), request("PLAIN"), timeout=5))
        assert not plain_reply.failed
        assert not plain_reply.HasField("next_interval_ms")

        failed = response(await nc.request(run_subject(subjects, "FAILS"), request("FAILS"), timeout=5))
        assert (failed.failed, failed.error) == (True, "upstream down")
        assert failed.retry_at.ToDatetime(tzinfo=UTC) == datetime(2030, 1, 1, tzinfo=UTC)

        crashed = response(await nc.request(run_subject(subjects, "CRASHES"), request("CRASHES"), timeout=5))
        assert crashed.failed
        assert crashed.error == "KeyError: 'missing'"

        late = response(
            await nc.request(run_subject(subjects, "SLOW"), request("SLOW", deadline_s=0.3), timeout=5)
        )
        assert late.failed
        assert late.error.startswith("TASK_DEADLINE_EXCEEDED")

        garbage = await nc.request(run_subject(subjects, "PLAIN"), b"\xff\x00garbage", timeout=5)
        assert (garbage.headers or {}).get(STATUS) == "error"
        assert common_pb2.Error.FromString(garbage.data).code == "INVALID_PAYLOAD"

        probe = await nc.request(run_subject(subjects, "SLOW"), b"", timeout=5, headers={PROBE_HEADER: "1"})
        assert (probe.headers or {}).get(STATUS) == "ok"
        with pytest.raises(nats.errors.NoRespondersError):
            await nc.request(run_subject(subjects, "NOBODY"), request("NOBODY"), timeout=5)
    finally:
        await host.stop(timeout=2)


async def test_replicas_of_a_worker_share_the_runs(test_env: SessionEnv, worker_bus: Bus) -> None:
    counts = {"a": 0, "b": 0}
    hosts = []
    buses = []
    for label in counts:
        workers = Workers()

        async def handle(task: Task, lease: Lease, label: str = label) -> None:
            counts[label] += 1

        workers.add("SHARED", handle)
        bus = await Bus.connect(test_env.nats_url, name=f"worker-{label}", namespace=worker_bus.subjects.ns)
        buses.append(bus)
        hosts.append(WorkerHost(bus, service=label, workers=workers))
        await hosts[-1].start()
    try:
        for _ in range(60):
            reply = await worker_bus.nc.request(
                run_subject(worker_bus.subjects, "SHARED"), request("SHARED"), timeout=5
            )
            assert not response(reply).failed
        assert sum(counts.values()) == 60, "each run went to exactly one replica of the queue group"
        assert all(counts.values()), counts
    finally:
        for host, bus in zip(hosts, buses, strict=True):
            await host.stop(timeout=2)
            await bus.close()


async def test_heartbeats_keep_a_long_run_and_a_lost_lease_cancels_it(worker_bus: Bus) -> None:
    beats: list[scheduler_pb2.TaskHeartbeat] = []
    held = True
    cancelled = asyncio.Event()
    workers = Workers()

    @workers.worker("LONG")
    async def long(task: Task, lease: Lease) -> TaskResult:
        try:
            await asyncio.sleep(0.5)
            return TaskResult(next_interval_ms=1)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    heartbeat_subject = f"{worker_bus.subjects.ns}.scheduler.heartbeat.test"

    async def answer(msg: Msg) -> None:
        beats.append(scheduler_pb2.TaskHeartbeat.FromString(msg.data))
        await msg.respond(scheduler_pb2.TaskHeartbeatResponse(held=held).SerializeToString())

    await worker_bus.nc.subscribe(heartbeat_subject, cb=answer)
    host = WorkerHost(worker_bus, service="test", workers=workers)
    await host.start()
    try:
        subject = run_subject(worker_bus.subjects, "LONG")
        reply = await worker_bus.nc.request(
            subject, request("LONG", lease_ms=240, heartbeat=heartbeat_subject), timeout=5
        )
        assert response(reply).next_interval_ms == 1
        assert len(beats) >= 3, "a 0.5 s run with a 0.24 s lease heartbeats every 0.08 s"
        assert {(b.task_id, b.lease_token) for b in beats} == {("t-1", 7)}

        held = False
        with pytest.raises(nats.errors.TimeoutError):
            # A lost lease: the run is cancelled and nothing is reported.
            await worker_bus.nc.request(
                subject, request("LONG", lease_ms=240, heartbeat=heartbeat_subject), timeout=1
            )
        assert cancelled.is_set()
    finally:
        await host.stop(timeout=2)


def test_worker_names_must_be_subject_tokens() -> None:
    workers = Workers()

    async def handler(task: Task, lease: Lease) -> None:
        return None

    for bad in ("a.b", "a b", "*", ""):
        with pytest.raises(InvalidArgument):
            workers.add(bad, handler)
    workers.add("OK_NAME", handler)
    workers.add("OK_NAME", handler)  # the same handler twice is harmless

    async def other(task: Task, lease: Lease) -> None:
        return None

    with pytest.raises(InvalidArgument):
        workers.add("OK_NAME", other)


def batch(*runs: bytes) -> bytes:
    return scheduler_pb2.RunTaskBatch(
        runs=[scheduler_pb2.RunTaskRequest.FromString(run) for run in runs]
    ).SerializeToString()


async def test_a_batch_of_runs_is_answered_run_by_run_as_they_end(worker_bus: Bus) -> None:
    release = asyncio.Event()
    workers = Workers()

    @workers.worker("QUICK")
    async def quick(task: Task, lease: Lease) -> TaskResult:
        return TaskResult(next_interval_ms=float(task.values["n"]))

    @workers.worker("HELD")
    async def held(task: Task, lease: Lease) -> None:
        await release.wait()

    @workers.worker("FAILS")
    async def fails(task: Task, lease: Lease) -> None:
        raise TaskFailed("upstream down")

    def run(name: str, n: int) -> bytes:
        one = scheduler_pb2.RunTaskRequest.FromString(request(name))
        one.task.metadata.values.update({"n": n})
        return one.SerializeToString()

    replies: asyncio.Queue[Msg] = asyncio.Queue()

    async def collect(msg: Msg) -> None:
        await replies.put(msg)

    nc = worker_bus.nc
    inbox = nc.new_inbox()
    await nc.subscribe(inbox, cb=collect)
    host = WorkerHost(worker_bus, service="test", workers=workers)
    await host.start()
    try:
        # One request, five runs: three quick ones, one held until released, one of a name this
        # host does not serve (every name of a batch is the subject's in practice; the task's
        # name decides which handler runs, as for a single run).
        payload = batch(run("QUICK", 1), run("HELD", 2), run("QUICK", 3), run("FAILS", 4), run("NOBODY", 5))
        await nc.publish(
            run_subject(worker_bus.subjects, "QUICK"), payload, reply=inbox, headers={BATCH_HEADER: "5"}
        )
        answered: dict[int, scheduler_pb2.RunTaskReply] = {}
        messages = 0
        while len(answered) < 4:
            msg = await asyncio.wait_for(replies.get(), 5)
            assert (msg.headers or {}).get(STATUS) == "ok"
            messages += 1
            for reply in scheduler_pb2.RunTaskReplies.FromString(msg.data).replies:
                assert reply.index not in answered, "each run is answered once"
                answered[reply.index] = reply
        assert sorted(answered) == [0, 2, 3, 4], "the held run holds up no other"
        assert messages < 4, "runs that end together share a message"
        assert answered[0].response.next_interval_ms == 1
        assert answered[2].response.next_interval_ms == 3
        assert (answered[3].response.failed, answered[3].response.error) == (True, "upstream down")
        assert answered[4].error.code == "WORKER_UNKNOWN"
        release.set()
        last = scheduler_pb2.RunTaskReplies.FromString((await asyncio.wait_for(replies.get(), 5)).data)
        assert [(r.index, r.response.failed) for r in last.replies] == [(1, False)]

        # A batch that does not decode, or holds too many runs, is refused once, as a whole.
        for bad in (b"\xff\x00garbage", batch(*[run("QUICK", i) for i in range(MAX_BATCH_RUNS + 1)])):
            await nc.publish(
                run_subject(worker_bus.subjects, "QUICK"), bad, reply=inbox, headers={BATCH_HEADER: "1"}
            )
            refused = await asyncio.wait_for(replies.get(), 5)
            assert (refused.headers or {}).get(STATUS) == "error"
            assert common_pb2.Error.FromString(refused.data).code == "INVALID_PAYLOAD"
        await asyncio.sleep(0.2)
        assert replies.empty(), "nothing of a refused batch ran"
    finally:
        await host.stop(timeout=2)
