"""Protobuf at the edge: wire messages to domain inputs, stored rows to wire messages."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from google.protobuf import json_format
from google.protobuf.timestamp_pb2 import Timestamp

from parley.v1 import scheduler_pb2
from parley_platform.postgres import Row

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


def ts(value: datetime | None) -> Timestamp | None:
    if value is None:
        return None
    stamp = Timestamp()
    stamp.FromDatetime(value)
    return stamp


def moment(stamp: Timestamp, field_name: str) -> datetime:
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


def metadata_of(row: Row) -> scheduler_pb2.TaskMetadata:
    meta = scheduler_pb2.TaskMetadata(
        not_before_ms=float(row["not_before_ms"]),
        max_failures=float(row["max_failures"]),
        max_attempts=row["max_attempts"],
        blocking=row["blocking"],
        missed_run=MISSED_VALUES[domain.MissedRun(row["missed_run"])],
        cron=row["cron"] or "",
    )
    for name in ("update_interval_ms", "base_interval_ms", "not_after_ms", "timeout_ms"):
        if row[name] is not None:
            setattr(meta, name, float(row[name]))
    if row["scheduled_at"] is not None:
        meta.scheduled_at.FromDatetime(row["scheduled_at"])
    if row["values"]:
        meta.values.update(row["values"])
    return meta


def task_of(row: Row, *, db_now: datetime | None = None) -> scheduler_pb2.Task:
    task = scheduler_pb2.Task(
        id=str(row["id"]),
        agent_id=str(row["agent_id"]),
        name=row["name"],
        description=row["description"],
        tags=row["tags"],
        room_id=str(row["room_id"] or ""),
        world_id=str(row["world_id"] or ""),
        entity_id=str(row["entity_id"] or ""),
        metadata=metadata_of(row),
        status=STATUS_VALUES[domain.Status(row["status"])],
        failure_count=row["failure_count"],
        last_error=row["last_error"] or "",
        orphaned_no_worker=row["orphaned_no_worker"],
        pause_reason=row["pause_reason"] or "",
        attempt=row["attempt"],
        revision=row["revision"],
        run_count=row["run_count"],
    )
    for name in ("due_at", "last_run_at", "next_run_at", "created_at", "updated_at"):
        if row[name] is not None:
            getattr(task, name).FromDatetime(row[name])
    expires = row["lease_expires_at"]
    now = db_now or row.get("db_now")
    if expires is not None and (now is None or expires > now):
        task.lease.owner = row["lease_owner"]
        task.lease.token = row["lease_token"]
        task.lease.attempt = row["attempt"]
        task.lease.expires_at.FromDatetime(expires)
    return task


def executing(row: Row) -> bool:
    """A live lease holds the task, or one of its runs (a non-blocking task's)."""
    expires = row["lease_expires_at"]
    return (expires is not None and expires > row["db_now"]) or bool(row.get("live_runs"))
