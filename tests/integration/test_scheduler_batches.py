"""The scheduler's batched dispatch over a real NATS server: the runs of one worker name added in one
turn of the event loop go as one request (at most MAX_BATCH_RUNS runs), a lone run as a plain
RunTaskRequest; every run's reply comes to its own future, however the worker groups them; a run
given up on leaves the others waiting, and nothing is left listening once all are settled."""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import AsyncIterator

import pytest
from nats.aio.msg import Msg

from parley.v1 import common_pb2, scheduler_pb2
from parley_platform.bus import Bus, Inbox
from parley_platform.permissions import MAX_BATCH_RUNS
from parley_platform.worker import BATCH_HEADER, STATUS
from parley_scheduler.batches import RunBatches
from support import SessionEnv


@pytest.fixture
async def sched_bus(test_env: SessionEnv) -> AsyncIterator[Bus]:
    bus = await Bus.connect(test_env.nats_url, name="batches-test", namespace=f"b{secrets.token_hex(4)}")
    yield bus
    await bus.close()


@pytest.fixture
async def inbox(sched_bus: Bus) -> AsyncIterator[Inbox]:
    started = Inbox(sched_bus)
    await started.start()
    yield started
    await started.close()


def add(batches: RunBatches, subject: str, task_id: str) -> asyncio.Future[object]:
    run, future = batches.add(subject)
    run.task.id = task_id
    return future  # type: ignore[return-value]


async def test_runs_added_together_go_as_one_request_per_worker_name(sched_bus: Bus, inbox: Inbox) -> None:
    ns = sched_bus.subjects.ns
    received: dict[str, list[Msg]] = {"MANY": [], "LONE": []}

    async def worker(msg: Msg) -> None:
        name = msg.subject.rsplit(".", 1)[-1]
        received[name].append(msg)
        if not (msg.headers or {}).get(BATCH_HEADER):
            one = scheduler_pb2.RunTaskRequest.FromString(msg.data)
            await msg.respond(scheduler_pb2.RunTaskResponse(error=f"alone {one.task.id}").SerializeToString())
            return
        runs = scheduler_pb2.RunTaskBatch.FromString(msg.data).runs
        # Answered in two messages, the second first, and one run refused.
        first, second = scheduler_pb2.RunTaskReplies(), scheduler_pb2.RunTaskReplies()
        for index, run in enumerate(runs):
            reply = (first if index % 2 else second).replies.add(index=index)
            if run.task.id.endswith("-3"):
                reply.error.CopyFrom(common_pb2.Error(code="WORKER_UNKNOWN", message="no such worker"))
            else:
                reply.response.error = f"ran {run.task.id}"
        for part in (second, first):
            await sched_bus.nc.publish(msg.reply, part.SerializeToString(), headers={STATUS: "ok"})

    await sched_bus.nc.subscribe(f"{ns}.tasks.run.*", cb=worker)
    await sched_bus.nc.flush()
    batches = RunBatches(inbox)
    # One turn of the event loop: MAX_BATCH_RUNS + 6 runs of one name, one run of another.
    many = [add(batches, f"{ns}.tasks.run.MANY", f"m-{i}") for i in range(MAX_BATCH_RUNS + 6)]
    lone = add(batches, f"{ns}.tasks.run.LONE", "l-0")
    replies = await asyncio.wait_for(asyncio.gather(*many, lone), 10)

    assert [len(scheduler_pb2.RunTaskBatch.FromString(m.data).runs) for m in received["MANY"]] == [
        MAX_BATCH_RUNS,
        6,
    ], "a full batch goes at once, the rest when the loop turns"
    assert all((m.headers or {}).get(BATCH_HEADER) for m in received["MANY"])
    assert len(received["LONE"]) == 1
    assert not (received["LONE"][0].headers or {}).get(BATCH_HEADER), "a run alone goes as it always did"
    for i, reply in enumerate(replies[:-1]):
        if f"m-{i}".endswith("-3"):
            assert isinstance(reply, common_pb2.Error)
            assert reply.code == "WORKER_UNKNOWN"
        else:
            assert isinstance(reply, scheduler_pb2.RunTaskResponse)
            assert reply.error == f"ran m-{i}", "each run gets its own reply"
    assert isinstance(replies[-1], scheduler_pb2.RunTaskResponse)
    assert replies[-1].error == "alone l-0"
    assert inbox._listening == {}, "nothing is left listening once every run is answered"
    assert len(inbox) == 0


async def test_a_run_given_up_on_leaves_the_others_waiting_and_is_not_answered(
    sched_bus: Bus, inbox: Inbox
) -> None:
    ns = sched_bus.subjects.ns
    held: asyncio.Queue[Msg] = asyncio.Queue()

    async def worker(msg: Msg) -> None:
        await held.put(msg)

    await sched_bus.nc.subscribe(f"{ns}.tasks.run.SLOW", cb=worker)
    await sched_bus.nc.flush()
    batches = RunBatches(inbox)
    futures = [add(batches, f"{ns}.tasks.run.SLOW", f"s-{i}") for i in range(3)]
    msg = await asyncio.wait_for(held.get(), 10)
    futures[1].set_exception(TimeoutError("no heartbeat within the lease"))  # as the dispatcher's watch does
    answer = scheduler_pb2.RunTaskReplies()
    for index in range(3):
        answer.replies.add(index=index).response.error = f"ran {index}"
    await sched_bus.nc.publish(msg.reply, answer.SerializeToString(), headers={STATUS: "ok"})
    first, last = await asyncio.wait_for(asyncio.gather(futures[0], futures[2]), 10)
    assert (first.error, last.error) == ("ran 0", "ran 2")  # type: ignore[attr-defined]
    with pytest.raises(TimeoutError):
        futures[1].result()
    await asyncio.sleep(0)
    assert inbox._listening == {}


async def test_a_batch_nobody_serves_or_the_worker_refuses_fails_every_run(
    sched_bus: Bus, inbox: Inbox
) -> None:
    ns = sched_bus.subjects.ns
    batches = RunBatches(inbox)
    nobody = [add(batches, f"{ns}.tasks.run.NOBODY", f"n-{i}") for i in range(4)]
    results = await asyncio.wait_for(asyncio.gather(*nobody, return_exceptions=True), 10)
    assert [getattr(r, "code", None) for r in results] == ["NO_RESPONDERS"] * 4

    async def refuse(msg: Msg) -> None:
        error = common_pb2.Error(code="INVALID_PAYLOAD", message="the request is not a RunTaskBatch")
        await sched_bus.nc.publish(msg.reply, error.SerializeToString(), headers={STATUS: "error"})

    async def garble(msg: Msg) -> None:
        await sched_bus.nc.publish(msg.reply, b"\xff\xfe not protobuf", headers={STATUS: "ok"})

    await sched_bus.nc.subscribe(f"{ns}.tasks.run.REFUSES", cb=refuse)
    await sched_bus.nc.subscribe(f"{ns}.tasks.run.GARBLES", cb=garble)
    await sched_bus.nc.flush()
    refused = [add(batches, f"{ns}.tasks.run.REFUSES", f"r-{i}") for i in range(3)]
    garbled = [add(batches, f"{ns}.tasks.run.GARBLES", f"g-{i}") for i in range(3)]
    replies = await asyncio.wait_for(asyncio.gather(*refused, *garbled), 10)
    assert [r.code for r in replies] == ["INVALID_PAYLOAD"] * 3 + ["BAD_REPLY"] * 3  # type: ignore[attr-defined]
    assert inbox._listening == {}
