"""The scheduler's tasks on the wire: every field of a task as callers and workers see it, whether
the message is built on its own or written into a run's request."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta

import pytest

from parley.v1 import scheduler_pb2
from parley_scheduler.convert import lease_to_proto, task_to_proto
from parley_scheduler.domain import Lease, MissedRun, PauseReason, Schedule, Status, Task

NOW = datetime(2026, 12, 7, 8, 30, 15, 123456, tzinfo=UTC)


def stamp(value: datetime) -> tuple[int, int]:
    return int(value.timestamp()), value.microsecond * 1000


def full_task() -> Task:
    """Every optional field set, the lease live when read."""
    return Task(
        id=uuid.uuid4(),
        agent_id=uuid.uuid4(),
        name="WORK",
        description="every field",
        tags=("repeat", "queue"),
        room_id=uuid.uuid4(),
        world_id=uuid.uuid4(),
        entity_id=uuid.uuid4(),
        due_at=NOW - timedelta(minutes=1),
        schedule=Schedule(
            update_interval_ms=60_000,
            base_interval_ms=30_000,
            not_before_ms=1_000,
            not_after_ms=900_000,
            max_failures=4,
            max_attempts=2,
            blocking=False,
            missed_run=MissedRun.SKIP,
            cron="*/5 * * * *",
            scheduled_at=NOW - timedelta(hours=1),
            timeout_ms=20_000,
        ),
        values={"n": 1, "s": "x", "nested": {"ok": True}},
        status=Status.PAUSED,
        pause_reason=PauseReason.MAX_FAILURES,
        failure_count=4,
        last_error="boom",
        last_run_at=NOW - timedelta(seconds=30),
        run_count=7,
        next_run_at=NOW + timedelta(minutes=5),
        ready_at=NOW + timedelta(minutes=5),
        orphaned_no_worker=True,
        attempt=3,
        lease=Lease("scheduler-1", 42, NOW + timedelta(seconds=30)),
        revision=9,
        created_at=NOW - timedelta(days=1),
        updated_at=NOW - timedelta(seconds=1),
        read_at=NOW,
    )


def bare_task() -> Task:
    """Every optional field unset, the lease expired when read."""
    return Task(
        id=uuid.uuid4(),
        agent_id=uuid.uuid4(),
        name="ONCE",
        description="",
        tags=(),
        room_id=None,
        world_id=None,
        entity_id=None,
        due_at=None,
        schedule=Schedule(),
        values={},
        status=Status.ACTIVE,
        pause_reason=None,
        failure_count=0,
        last_error=None,
        last_run_at=None,
        run_count=0,
        next_run_at=NOW,
        ready_at=NOW,
        orphaned_no_worker=False,
        attempt=1,
        lease=Lease("scheduler-1", 7, NOW - timedelta(seconds=1)),
        revision=1,
        created_at=NOW,
        updated_at=NOW,
        read_at=NOW,
    )


def test_every_field_of_a_task_reaches_the_wire() -> None:
    task = full_task()
    proto = task_to_proto(task)
    assert (proto.id, proto.agent_id, proto.name, proto.description) == (
        str(task.id),
        str(task.agent_id),
        "WORK",
        "every field",
    )
    assert list(proto.tags) == ["repeat", "queue"]
    assert (proto.room_id, proto.world_id, proto.entity_id) == (
        str(task.room_id),
        str(task.world_id),
        str(task.entity_id),
    )
    assert proto.status == scheduler_pb2.TASK_STATUS_PAUSED
    assert proto.pause_reason == PauseReason.MAX_FAILURES.value
    assert (proto.failure_count, proto.last_error, proto.run_count) == (4, "boom", 7)
    assert (proto.attempt, proto.revision, proto.orphaned_no_worker) == (3, 9, True)
    for field, value in (
        (proto.due_at, task.due_at),
        (proto.last_run_at, task.last_run_at),
        (proto.next_run_at, task.next_run_at),
        (proto.created_at, task.created_at),
        (proto.updated_at, task.updated_at),
    ):
        assert value is not None
        assert (field.seconds, field.nanos) == stamp(value)
    meta = proto.metadata
    assert (meta.update_interval_ms, meta.base_interval_ms, meta.not_before_ms, meta.not_after_ms) == (
        60_000.0,
        30_000.0,
        1_000.0,
        900_000.0,
    )
    assert (meta.max_failures, meta.max_attempts, meta.blocking, meta.timeout_ms) == (4.0, 2, False, 20_000.0)
    assert (meta.missed_run, meta.cron) == (scheduler_pb2.MISSED_RUN_SKIP, "*/5 * * * *")
    assert (meta.scheduled_at.seconds, meta.scheduled_at.nanos) == stamp(NOW - timedelta(hours=1))
    assert dict(meta.values) == {"n": 1.0, "s": "x", "nested": {"ok": True}}
    assert proto.HasField("lease")
    assert (proto.lease.owner, proto.lease.token, proto.lease.attempt) == ("scheduler-1", 42, 3)
    assert (proto.lease.expires_at.seconds, proto.lease.expires_at.nanos) == stamp(
        NOW + timedelta(seconds=30)
    )
    assert not proto.lease.HasField("deadline")


def test_unset_fields_stay_unset_and_an_expired_lease_is_left_out() -> None:
    proto = task_to_proto(bare_task())
    for name in ("due_at", "last_run_at", "lease"):
        assert not proto.HasField(name), name
    assert (proto.room_id, proto.world_id, proto.entity_id, proto.last_error, proto.pause_reason) == ("",) * 5
    meta = proto.metadata
    assert not meta.HasField("update_interval_ms")
    assert not meta.HasField("base_interval_ms")
    assert not meta.HasField("not_after_ms")
    assert not meta.HasField("timeout_ms")
    assert not meta.HasField("scheduled_at")
    assert meta.cron == ""
    assert not meta.HasField("values") or not meta.values.fields


@pytest.mark.parametrize("make", [full_task, bare_task])
def test_a_task_written_into_a_runs_request_is_the_task_built_alone(make: object) -> None:
    task = make()  # type: ignore[operator]
    assert task.lease is not None
    deadline = NOW + timedelta(seconds=20)
    request = scheduler_pb2.RunTaskRequest(heartbeat_subject="hb", lease_ms=30_000.0)
    task_to_proto(task, out=request.task)
    lease_to_proto(task.lease, task.attempt, deadline, out=request.lease)
    assert request.task == task_to_proto(task)
    assert request.lease == lease_to_proto(task.lease, task.attempt, deadline)
    assert (request.lease.deadline.seconds, request.lease.deadline.nanos) == stamp(deadline)
    assert (request.heartbeat_subject, request.lease_ms) == ("hb", 30_000.0)
