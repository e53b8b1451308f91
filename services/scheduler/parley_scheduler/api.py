"""The ``parley.v1.Scheduler`` service, served over gRPC and NATS."""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import replace
from datetime import UTC, datetime
from typing import Any

from psycopg.types.json import Jsonb

from parley.v1 import scheduler_pb2
from parley_platform.errors import Conflict, FailedPrecondition, InvalidArgument, NotFound, ParleyError
from parley_platform.logging import get_logger
from parley_platform.paging import cut, page_of
from parley_platform.postgres import Row

from . import convert, domain
from .engine import Engine, Report, SchedulerMetrics
from .store import SchedulerStore, insert_row, schedule_of

log = get_logger(__name__)

MAX_BATCH = 1000
DEFAULT_DUE_LIMIT = 100
METADATA_FIELDS = {
    "update_interval_ms",
    "base_interval_ms",
    "not_before_ms",
    "not_after_ms",
    "max_failures",
    "max_attempts",
    "blocking",
    "missed_run",
    "cron",
    "scheduled_at",
    "timeout_ms",
    "values",
}
TOP_FIELDS = {"description", "tags", "room_id", "world_id", "entity_id", "due_at", "metadata"}
UPDATE_RETRIES = 5


def _task_id(value: str) -> uuid.UUID:
    parsed = domain.parse_uuid(value, "id", required=True)
    assert parsed is not None
    return parsed


def _agent(value: str) -> uuid.UUID | None:
    return domain.parse_uuid(value, "agent_id")


def _not_found(task_id: uuid.UUID) -> NotFound:
    return NotFound(f"no task {task_id}", code="TASK_NOT_FOUND", hint="list them with `parley tasks list`")


def _metadata_input(row: Row) -> domain.MetadataInput:
    schedule = schedule_of(row)
    return domain.MetadataInput(
        update_interval_ms=schedule.update_interval_ms,
        base_interval_ms=schedule.base_interval_ms,
        not_before_ms=schedule.not_before_ms,
        not_after_ms=schedule.not_after_ms,
        max_failures=schedule.max_failures,
        max_attempts=schedule.max_attempts,
        blocking=schedule.blocking,
        missed_run=schedule.missed_run.value,
        cron=schedule.cron or "",
        scheduled_at=schedule.scheduled_at,
        timeout_ms=schedule.timeout_ms,
    )


class SchedulerApi:
    def __init__(
        self,
        *,
        store: SchedulerStore,
        engine: Engine,
        metrics: SchedulerMetrics,
        claim_loop: bool,
    ) -> None:
        self.store = store
        self.engine = engine
        self.metrics = metrics
        self.claim_loop = claim_loop
        self._background: set[asyncio.Task[Any]] = set()

    # --- creating ---------------------------------------------------------------------------

    async def CreateTask(self, request: scheduler_pb2.CreateTaskRequest) -> scheduler_pb2.CreateTaskResponse:
        task = convert.new_task(request.task)
        rows = await self._insert([task])
        return scheduler_pb2.CreateTaskResponse(task=convert.task_of(rows[0]))

    async def CreateTasks(
        self, request: scheduler_pb2.CreateTasksRequest
    ) -> scheduler_pb2.CreateTasksResponse:
        if not 1 <= len(request.tasks) <= MAX_BATCH:
            raise InvalidArgument(f"tasks must hold 1 to {MAX_BATCH} tasks", code="TASK_BATCH_INVALID")
        tasks = []
        for index, spec in enumerate(request.tasks):
            try:
                tasks.append(convert.new_task(spec))
            except InvalidArgument as exc:
                raise InvalidArgument(f"tasks[{index}].{exc.message}", code=exc.code, hint=exc.hint) from None
        if len({t.id for t in tasks}) != len(tasks):
            raise InvalidArgument("tasks contains the same id twice", code="TASK_BATCH_INVALID")
        rows = await self._insert(tasks)
        return scheduler_pb2.CreateTasksResponse(ids=[str(row["id"]) for row in rows])

    async def _insert(self, tasks: list[domain.NewTask]) -> list[Row]:
        now = datetime.now(UTC)
        try:
            rows = await self.store.insert([insert_row(task, now) for task in tasks])
        except Conflict as exc:
            raise Conflict(
                "a task with this id already exists" if len(tasks) == 1 else "a task id already exists",
                code="TASK_EXISTS",
                hint="leave id empty to get a new one",
            ) from exc
        return rows

    # --- reading ----------------------------------------------------------------------------

    async def GetTask(self, request: scheduler_pb2.GetTaskRequest) -> scheduler_pb2.GetTaskResponse:
        task_id = _task_id(request.id)
        row = await self.store.get(task_id, _agent(request.agent_id))
        if row is None:
            raise _not_found(task_id)
        return scheduler_pb2.GetTaskResponse(task=convert.task_of(row))

    async def ListTasks(self, request: scheduler_pb2.ListTasksRequest) -> scheduler_pb2.ListTasksResponse:
        page = page_of(request.page if request.HasField("page") else None)
        status = convert.STATUS_NAMES.get(request.status)
        if request.status and status is None:
            raise InvalidArgument("status is not a known task status", code="TASK_INVALID")
        tags = list(domain.validate_tags(list(request.tags)))
        if request.name:
            domain.validate_name(request.name)
        rows, page_response = cut(
            page,
            await self.store.list_tasks(
                agent_id=_agent(request.agent_id),
                tags=tags,
                status=status.value if status else None,
                name=request.name or None,
                limit=page.fetch,
                offset=page.offset,
            ),
        )
        return scheduler_pb2.ListTasksResponse(tasks=[convert.task_of(r) for r in rows], page=page_response)

    async def GetTaskStatus(
        self, request: scheduler_pb2.GetTaskStatusRequest
    ) -> scheduler_pb2.GetTaskStatusResponse:
        task_id = _task_id(request.id)
        agent = _agent(request.agent_id)
        row = await self.store.get(task_id, agent)
        if row is None:
            return scheduler_pb2.GetTaskStatusResponse(paused=False, executing=False)
        response = scheduler_pb2.GetTaskStatusResponse(
            task=convert.task_of(row),
            paused=row["status"] == domain.Status.PAUSED,
            executing=convert.executing(row),
            last_error=row["last_error"] or "",
        )
        response.next_run_at.FromDatetime(row["next_run_at"])
        for attempt in await self.store.uncertain_attempts(task_id, agent):
            entry = response.uncertain_attempts.add(attempt=attempt["attempt"], owner=attempt["owner"])
            for name in ("claimed_at", "expired_at", "reclaimed_at"):
                if attempt[name] is not None:
                    getattr(entry, name).FromDatetime(attempt[name])
        return response

    # --- changing ---------------------------------------------------------------------------

    async def UpdateTask(self, request: scheduler_pb2.UpdateTaskRequest) -> scheduler_pb2.UpdateTaskResponse:
        task_id = _task_id(request.id)
        agent = _agent(request.agent_id)
        paths = list(request.update_mask.paths)
        if not paths:
            raise InvalidArgument("update_mask must name the fields to change", code="TASK_INVALID")
        for path in paths:
            head, _, rest = path.partition(".")
            if head not in TOP_FIELDS or (rest and (head != "metadata" or rest not in METADATA_FIELDS)):
                raise InvalidArgument(
                    f"update_mask: {path!r} is not a field that can change", code="TASK_INVALID"
                )
        for _ in range(UPDATE_RETRIES):
            row = await self.store.get(task_id, agent)
            if row is None:
                raise _not_found(task_id)
            if request.expected_revision and row["revision"] != request.expected_revision:
                raise Conflict(
                    f"task {task_id} is at revision {row['revision']}, not {request.expected_revision}",
                    code="TASK_REVISION_CHANGED",
                    hint="read it again and reapply the change",
                    retryable=True,
                )
            updated = await self.store.update(self._merged(row, request.task, set(paths)))
            if updated is not None:
                self.engine.wake()
                return scheduler_pb2.UpdateTaskResponse(task=convert.task_of(updated))
            if request.expected_revision:
                break
        raise Conflict(
            f"task {task_id} kept changing while it was updated",
            code="TASK_REVISION_CHANGED",
            hint="retry the update",
            retryable=True,
        )

    def _merged(self, row: Row, spec: scheduler_pb2.TaskSpec, paths: set[str]) -> dict[str, Any]:
        """The row after the masked fields of ``spec`` replace it, validated as a whole."""

        def changes(name: str) -> bool:
            return f"metadata.{name}" in paths or "metadata" in paths

        meta = _metadata_input(row)
        given = convert.metadata_input(spec.metadata)
        overrides = {name: getattr(given, name) for name in METADATA_FIELDS - {"values"} if changes(name)}
        meta = replace(meta, **overrides)
        tags = list(domain.validate_tags(list(spec.tags))) if "tags" in paths else list(row["tags"])
        repeat = domain.REPEAT_TAG in tags
        schedule = domain.validate_schedule(meta, repeat=repeat)
        due_at = convert.optional_moment(spec, "due_at", "due_at") if "due_at" in paths else row["due_at"]
        values = (
            domain.validate_values(convert.values_of(spec.metadata)) if changes("values") else row["values"]
        )
        rescheduled = bool({"due_at", "tags", "metadata"} & paths) or any(
            changes(name) for name in ("update_interval_ms", "cron", "scheduled_at", "not_before_ms")
        )
        next_run_at = row["next_run_at"]
        if rescheduled:
            next_run_at = self._next_run(
                row, schedule, repeat=repeat, due_at=due_at, due_changed="due_at" in paths
            )

        def uuid_field(name: str) -> uuid.UUID | None:
            if name in paths:
                return domain.parse_uuid(getattr(spec, name), name)
            value: uuid.UUID | None = row[name]
            return value

        return {
            "id": row["id"],
            "revision": row["revision"],
            "description": domain.validate_description(spec.description)
            if "description" in paths
            else row["description"],
            "tags": tags,
            "room_id": uuid_field("room_id"),
            "world_id": uuid_field("world_id"),
            "entity_id": uuid_field("entity_id"),
            "due_at": due_at,
            "scheduled_at": schedule.scheduled_at,
            "update_interval_ms": schedule.update_interval_ms,
            "base_interval_ms": schedule.base_interval_ms,
            "not_before_ms": schedule.not_before_ms,
            "not_after_ms": schedule.not_after_ms,
            "max_failures": schedule.max_failures,
            "max_attempts": schedule.max_attempts,
            "blocking": schedule.blocking,
            "missed_run": schedule.missed_run.value,
            "cron": schedule.cron,
            "timeout_ms": schedule.timeout_ms,
            "values": Jsonb(values),
            "next_run_at": next_run_at,
            "ready_at": domain.ready_at(next_run_at, schedule, repeat=repeat),
        }

    @staticmethod
    def _next_run(
        row: Row, schedule: domain.Schedule, *, repeat: bool, due_at: datetime | None, due_changed: bool
    ) -> datetime:
        now = datetime.now(UTC)
        if due_changed and due_at is not None:
            return due_at
        if not repeat:
            return due_at or schedule.scheduled_at or now
        parsed = schedule.parsed_cron()
        if parsed is not None:
            return parsed.next_after(now)
        assert schedule.update_interval_ms is not None
        last: datetime = row["last_run_at"] or row["created_at"]
        return domain.first_run(repeat=True, schedule=schedule, due_at=None, created_at=last)

    async def DeleteTask(self, request: scheduler_pb2.DeleteTaskRequest) -> scheduler_pb2.DeleteTaskResponse:
        task_id = _task_id(request.id)
        row = await self.store.delete(task_id, _agent(request.agent_id))
        if row is None:
            raise _not_found(task_id)
        log.info("task deleted", task_id=str(task_id), worker=row["name"])
        return scheduler_pb2.DeleteTaskResponse(task=convert.task_of(row))

    async def PauseTask(self, request: scheduler_pb2.PauseTaskRequest) -> scheduler_pb2.PauseTaskResponse:
        task_id = _task_id(request.id)
        agent = _agent(request.agent_id)
        row = await self.store.pause(task_id, agent)
        if row is None:
            current = await self.store.get(task_id, agent)
            if current is None:
                raise _not_found(task_id)
            if current["status"] == domain.Status.FAILED:
                raise FailedPrecondition(
                    f"task {task_id} failed; there is nothing to pause",
                    code="TASK_FAILED",
                    hint="resume it to run it again, or delete it",
                )
            return scheduler_pb2.PauseTaskResponse(task=convert.task_of(current))
        self.metrics.paused.labels(domain.PauseReason.OPERATOR.value).inc()
        log.info("task paused", task_id=str(task_id), worker=row["name"], reason="operator")
        return scheduler_pb2.PauseTaskResponse(task=convert.task_of(row))

    async def ResumeTask(self, request: scheduler_pb2.ResumeTaskRequest) -> scheduler_pb2.ResumeTaskResponse:
        task_id = _task_id(request.id)
        agent = _agent(request.agent_id)
        row = await self.store.resume(task_id, agent, now=request.run_immediately)
        if row is None and request.run_immediately:
            row = await self.store.run_soon(task_id, agent)
        if row is None:
            current = await self.store.get(task_id, agent)
            if current is None:
                raise _not_found(task_id)
            if current["status"] == domain.Status.RUNNING or not request.run_immediately:
                return scheduler_pb2.ResumeTaskResponse(task=convert.task_of(current))
            raise FailedPrecondition(f"task {task_id} cannot be resumed", code="TASK_NOT_PAUSED")
        log.info("task resumed", task_id=str(task_id), worker=row["name"], now=request.run_immediately)
        if request.run_immediately and (not row["queued"] or not self.claim_loop):
            # Nothing polls this task: run it here, without making the caller wait for the run.
            background = asyncio.create_task(self._execute_in_background(task_id, agent))
            self._background.add(background)
            background.add_done_callback(self._background.discard)
        self.engine.wake()
        return scheduler_pb2.ResumeTaskResponse(task=convert.task_of(row))

    # --- running ----------------------------------------------------------------------------

    async def _execute(self, task_id: uuid.UUID, agent: uuid.UUID | None) -> Report:
        cfg = self.engine.config
        claimed = await self.store.claim_one(task_id, agent, cfg.owner, cfg.lease_ms)
        if claimed is None:
            current = await self.store.get(task_id, agent)
            if current is None:
                raise _not_found(task_id)
            self.metrics.conflicts.inc()
            raise Conflict(
                f"task {task_id} is running (lease held by {current['lease_owner']})",
                code="TASK_RUNNING",
                hint="wait for the run to finish",
                retryable=True,
            )
        if claimed.reclaimed:
            self.metrics.lease_expired.inc()
        # The run goes on even if the caller gives up waiting: its lease is ours to complete.
        return await asyncio.shield(self.engine.spawn(claimed))

    async def _execute_in_background(self, task_id: uuid.UUID, agent: uuid.UUID | None) -> None:
        try:
            report = await self._execute(task_id, agent)
        except ParleyError as exc:
            log.info("resumed task not run at once", task_id=str(task_id), error=exc.code)
            return
        log.info("resumed task ran", task_id=str(task_id), outcome=report.outcome.value)

    async def ExecuteTask(
        self, request: scheduler_pb2.ExecuteTaskRequest
    ) -> scheduler_pb2.ExecuteTaskResponse:
        report = await self._execute(_task_id(request.id), _agent(request.agent_id))
        return scheduler_pb2.ExecuteTaskResponse(run=report.to_proto())

    async def RunDueTasks(
        self, request: scheduler_pb2.RunDueTasksRequest
    ) -> scheduler_pb2.RunDueTasksResponse:
        limit = request.limit or DEFAULT_DUE_LIMIT
        if not 1 <= limit <= MAX_BATCH:
            raise InvalidArgument(f"limit must be from 1 to {MAX_BATCH}", code="INVALID_LIMIT")
        cfg = self.engine.config
        claimed = await self.store.claim_due(cfg.owner, cfg.lease_ms, limit)
        for task in claimed:
            if task.reclaimed:
                self.metrics.lease_expired.inc()
        runs = [self.engine.spawn(task) for task in claimed]
        reports = await asyncio.shield(asyncio.gather(*runs)) if runs else []
        return scheduler_pb2.RunDueTasksResponse(runs=[r.to_proto() for r in reports])

    async def RegisterWorker(
        self, request: scheduler_pb2.RegisterWorkerRequest
    ) -> scheduler_pb2.RegisterWorkerResponse:
        name = domain.validate_name(request.name)
        service = request.service.strip()
        if not service or len(service) > 100:
            raise InvalidArgument("service must be 1-100 characters", code="TASK_INVALID")
        await self.store.register_worker(name, service)
        resumed = await self.store.resume_orphans(name)
        if resumed:
            log.info("orphaned tasks resumed, worker registered", worker=name, service=service, tasks=resumed)
            self.engine.wake()
        return scheduler_pb2.RegisterWorkerResponse(resumed=resumed)

    async def close(self) -> None:
        for task in list(self._background):
            task.cancel()
        if self._background:
            await asyncio.wait(set(self._background), timeout=2)
