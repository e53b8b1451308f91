"""Protobuf at the edge: wire messages to domain inputs, domain objects to wire messages."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from google.protobuf import json_format
from google.protobuf.timestamp_pb2 import Timestamp

from parley.v1 import scheduler_pb2
from parley_platform.convert import set_timestamp, timestamp

from . import domain

STATUS_VALUES = {
    domain.Status.ACTIVE: scheduler_pb2.TASK_STATUS_ACTIVE,
    domain.Status.PAUSED: scheduler_pb2.TASK_STATUS_PAUSED,
    domain.Status.RUNNING: scheduler_pb2.TASK_STATUS_RUNNING,
    domain.Status.FAILED: scheduler_pb2.TASK_STATUS_FAILED,
}
STATUS_NAMES = {value: status for status, value in STATUS_VALUES.items()}
MISSED_VALUES = {
    domain.MissedRun.RUN_ONCE: scheduler_pb2.MISSED_RUN_RUN_ONCE,
    domain.MissedRun.SKIP: scheduler_pb2.MISSED_RUN_SKIP,
}
MISSED_NAMES = {
    scheduler_pb2.MISSED_RUN_UNSPECIFIED: None,
    scheduler_pb2.MISSED_RUN_RUN_ONCE: domain.MissedRun.RUN_ONCE.value,
    scheduler_pb2.MISSED_RUN_SKIP: domain.MissedRun.SKIP.value,
}
OUTCOME_VALUES = {
    domain.Outcome.SUCCEEDED: scheduler_pb2.TASK_OUTCOME_SUCCEEDED,
    domain.Outcome.FAILED: scheduler_pb2.TASK_OUTCOME_FAILED,
    domain.Outcome.NO_WORKER: scheduler_pb2.TASK_OUTCOME_NO_WORKER,
    domain.Outcome.UNCERTAIN: scheduler_pb2.TASK_OUTCOME_UNCERTAIN,
    domain.Outcome.SKIPPED: scheduler_pb2.TASK_OUTCOME_SKIPPED,
    domain.Outcome.LOST: scheduler_pb2.TASK_OUTCOME_LOST,
}


# --- from the wire ------------------------------------------------------------------------------


def moment(stamp: Timestamp, field_name: str) -> datetime:
    """A time a caller sent. Unlike ``parley_platform.convert.datetime_of`` the epoch is a time
    like any other (fields that may be absent are tested with ``HasField``), and one out of
    Python's range is the schedule's error, naming the field."""
    try:
        return stamp.ToDatetime(tzinfo=UTC)
    except (ValueError, OverflowError, OSError):
        raise domain.schedule_invalid(field_name, "is not a valid time") from None


def optional_moment(message: Any, field_name: str, path: str) -> datetime | None:
    if not message.HasField(field_name):
        return None
    return moment(getattr(message, field_name), path)


def metadata_input(meta: scheduler_pb2.TaskMetadata) -> domain.MetadataInput:
    message: Any = meta

    def opt(name: str) -> Any:
        return getattr(message, name) if message.HasField(name) else None

    return domain.MetadataInput(
        update_interval_ms=opt("update_interval_ms"),
        base_interval_ms=opt("base_interval_ms"),
        not_before_ms=opt("not_before_ms"),
        not_after_ms=opt("not_after_ms"),
        max_failures=opt("max_failures"),
        max_attempts=opt("max_attempts"),
        blocking=opt("blocking"),
        missed_run=MISSED_NAMES.get(meta.missed_run, "invalid"),
        cron=meta.cron,
        scheduled_at=optional_moment(meta, "scheduled_at", "metadata.scheduled_at"),
        timeout_ms=opt("timeout_ms"),
    )


def values_of(meta: scheduler_pb2.TaskMetadata) -> dict[str, Any]:
    return json_format.MessageToDict(meta.values) if meta.HasField("values") else {}


def new_task(spec: scheduler_pb2.TaskSpec) -> domain.NewTask:
    meta = spec.metadata
    return domain.new_task(
        id=spec.id,
        agent_id=spec.agent_id,
        name=spec.name,
        description=spec.description,
        tags=list(spec.tags),
        room_id=spec.room_id,
        world_id=spec.world_id,
        entity_id=spec.entity_id,
        due_at=optional_moment(spec, "due_at", "due_at"),
        metadata=metadata_input(meta),
        values=values_of(meta),
    )


# --- to the wire --------------------------------------------------------------------------------


def metadata_to_proto(
    schedule: domain.Schedule, values: dict[str, Any], out: scheduler_pb2.TaskMetadata | None = None
) -> scheduler_pb2.TaskMetadata:
    """The task's metadata, written into ``out`` (a field of the message being built) if given."""
    meta = scheduler_pb2.TaskMetadata() if out is None else out
    meta.not_before_ms = float(schedule.not_before_ms)
    meta.max_failures = float(schedule.max_failures)
    meta.max_attempts = schedule.max_attempts
    meta.blocking = schedule.blocking
    meta.missed_run = MISSED_VALUES[schedule.missed_run]
    if schedule.cron:
        meta.cron = schedule.cron
    set_timestamp(meta.scheduled_at, schedule.scheduled_at)
    if schedule.update_interval_ms is not None:
        meta.update_interval_ms = float(schedule.update_interval_ms)
    if schedule.base_interval_ms is not None:
        meta.base_interval_ms = float(schedule.base_interval_ms)
    if schedule.not_after_ms is not None:
        meta.not_after_ms = float(schedule.not_after_ms)
    if schedule.timeout_ms is not None:
        meta.timeout_ms = float(schedule.timeout_ms)
    if values:
        meta.values.update(values)
    return meta


def lease_to_proto(
    lease: domain.Lease,
    attempt: int,
    deadline: datetime | None = None,
    out: scheduler_pb2.TaskLease | None = None,
) -> scheduler_pb2.TaskLease:
    """The lease, written into ``out`` (a field of the message being built) if given."""
    proto = scheduler_pb2.TaskLease() if out is None else out
    proto.owner = lease.owner
    proto.token = lease.token
    proto.attempt = attempt
    set_timestamp(proto.expires_at, lease.expires_at)
    set_timestamp(proto.deadline, deadline)
    return proto


def task_to_proto(task: domain.Task, out: scheduler_pb2.Task | None = None) -> scheduler_pb2.Task:
    """The task as callers see it; its lease only while live when the task was read. Written into
    ``out`` (a field of the message being built, such as a run's request) if given: building a
    message apart and passing it to its parent's constructor copies it (a run's request was 35 µs
    of the scheduler's CPU per run, docs/performance.md)."""
    proto = scheduler_pb2.Task() if out is None else out
    proto.id = str(task.id)
    proto.agent_id = str(task.agent_id)
    proto.name = task.name
    proto.description = task.description
    proto.tags.extend(task.tags)
    if task.room_id is not None:
        proto.room_id = str(task.room_id)
    if task.world_id is not None:
        proto.world_id = str(task.world_id)
    if task.entity_id is not None:
        proto.entity_id = str(task.entity_id)
    metadata_to_proto(task.schedule, task.values, proto.metadata)
    proto.status = STATUS_VALUES[task.status]
    proto.failure_count = task.failure_count
    if task.last_error:
        proto.last_error = task.last_error
    proto.orphaned_no_worker = task.orphaned_no_worker
    if task.pause_reason:
        proto.pause_reason = task.pause_reason.value
    proto.attempt = task.attempt
    proto.revision = task.revision
    proto.run_count = task.run_count
    set_timestamp(proto.due_at, task.due_at)
    set_timestamp(proto.last_run_at, task.last_run_at)
    set_timestamp(proto.next_run_at, task.next_run_at)
    set_timestamp(proto.created_at, task.created_at)
    set_timestamp(proto.updated_at, task.updated_at)
    lease = task.live_lease
    if lease is not None:
        lease_to_proto(lease, task.attempt, out=proto.lease)
    return proto


def uncertain_to_proto(attempt: domain.UncertainAttempt) -> scheduler_pb2.UncertainAttempt:
    return scheduler_pb2.UncertainAttempt(
        attempt=attempt.attempt,
        owner=attempt.owner,
        claimed_at=timestamp(attempt.claimed_at),
        expired_at=timestamp(attempt.expired_at),
        reclaimed_at=timestamp(attempt.reclaimed_at),
    )


def run_to_proto(report: domain.RunReport) -> scheduler_pb2.TaskRun:
    return scheduler_pb2.TaskRun(
        task_id=str(report.task_id),
        name=report.name,
        attempt=report.attempt,
        outcome=OUTCOME_VALUES[report.outcome],
        error=report.error,
        duration_ms=report.duration_ms,
        deleted=report.deleted,
    )
