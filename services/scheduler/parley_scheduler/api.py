"""The ``parley.v1.Scheduler`` service, served over gRPC and NATS."""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import replace
from datetime import UTC, datetime
from typing import Any

from parley.v1 import scheduler_pb2
from parley_platform import codes
from parley_platform.convert import timestamp
from parley_platform.errors import ErrorCode, InvalidArgument, ParleyError
from parley_platform.logging import get_logger
from parley_platform.paging import cut, page_of

from . import convert, domain, errors, rules
from .engine import Engine
from .metrics import SchedulerMetrics
from .store import SchedulerStore, insert_row

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
    return domain.required_uuid(value, "id")


def _agent(value: str) -> uuid.UUID | None:
    return domain.optional_uuid(value, "agent_id")


def _not_found(task_id: uuid.UUID) -> ParleyError:
    return errors.TASK_NOT_FOUND(f"no task {task_id}")


def _entry(exc: ParleyError) -> ErrorCode | None:
    """The catalog entry an error was raised from: the scheduler's, or the platform's."""
    for catalog in (errors.CATALOG, codes.CATALOG):
        if exc.code in catalog:
            return catalog[exc.code]
    return None


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
        [created] = await self._insert([task])
        return scheduler_pb2.CreateTaskResponse(task=convert.task_to_proto(created))

    async def CreateTasks(
        self, request: scheduler_pb2.CreateTasksRequest
    ) -> scheduler_pb2.CreateTasksResponse:
        if not 1 <= len(request.tasks) <= MAX_BATCH:
            raise errors.TASK_BATCH_INVALID(f"tasks must hold 1 to {MAX_BATCH} tasks")
        tasks = []
        for index, spec in enumerate(request.tasks):
            try:
                tasks.append(convert.new_task(spec))
            except InvalidArgument as exc:
                entry = _entry(exc)
                if entry is None:
                    raise
                # The same error, naming the task of the batch it is about.
                raise entry(f"tasks[{index}].{exc.message}", hint=exc.hint) from None
        if len({t.id for t in tasks}) != len(tasks):
            raise errors.TASK_BATCH_INVALID("tasks contains the same id twice")
        created = await self._insert(tasks)
        return scheduler_pb2.CreateTasksResponse(ids=[str(task.id) for task in created])

    async def _insert(self, tasks: list[domain.NewTask]) -> list[domain.Task]:
        now = datetime.now(UTC)
        try:
            return await self.store.insert([insert_row(task, now) for task in tasks])
        except ParleyError as exc:
            if not codes.ALREADY_EXISTS.matches(exc):
                raise
            raise errors.TASK_EXISTS(
                "a task with this id already exists" if len(tasks) == 1 else "a task id already exists"
            ) from exc

    # --- reading ----------------------------------------------------------------------------

    async def GetTask(self, request: scheduler_pb2.GetTaskRequest) -> scheduler_pb2.GetTaskResponse:
        task_id = _task_id(request.id)
        task = await self.store.get(task_id, _agent(request.agent_id))
        if task is None:
            raise _not_found(task_id)
        return scheduler_pb2.GetTaskResponse(task=convert.task_to_proto(task))

    async def ListTasks(self, request: scheduler_pb2.ListTasksRequest) -> scheduler_pb2.ListTasksResponse:
        page = page_of(request.page if request.HasField("page") else None)
        status = convert.STATUS_NAMES.get(request.status)
        if request.status and status is None:
            raise domain.invalid("status", "is not a known task status")
        tags = list(domain.validate_tags(list(request.tags)))
        if request.name:
            domain.validate_name(request.name)
        tasks, page_response = cut(
            page,
            await self.store.list_tasks(
                agent_id=_agent(request.agent_id),
                tags=tags,
                status=status,
                name=request.name or None,
                limit=page.fetch,
                offset=page.offset,
            ),
        )
        return scheduler_pb2.ListTasksResponse(
            tasks=[convert.task_to_proto(t) for t in tasks], page=page_response
        )

    async def GetTaskStatus(
        self, request: scheduler_pb2.GetTaskStatusRequest
    ) -> scheduler_pb2.GetTaskStatusResponse:
        task_id = _task_id(request.id)
        agent = _agent(request.agent_id)
        task = await self.store.get(task_id, agent)
        if task is None:
            return scheduler_pb2.GetTaskStatusResponse(paused=False, executing=False)
        attempts = await self.store.uncertain_attempts(task_id, agent)
        return scheduler_pb2.GetTaskStatusResponse(
            task=convert.task_to_proto(task),
            paused=task.status is domain.Status.PAUSED,
            executing=task.executing,
            last_error=task.last_error or "",
            next_run_at=timestamp(task.next_run_at),
            uncertain_attempts=[convert.uncertain_to_proto(a) for a in attempts],
        )

    # --- changing ---------------------------------------------------------------------------

    async def UpdateTask(self, request: scheduler_pb2.UpdateTaskRequest) -> scheduler_pb2.UpdateTaskResponse:
        task_id = _task_id(request.id)
        agent = _agent(request.agent_id)
        paths = list(request.update_mask.paths)
        if not paths:
            raise domain.invalid("update_mask", "must name the fields to change")
        for path in paths:
            head, _, rest = path.partition(".")
            if head not in TOP_FIELDS or (rest and (head != "metadata" or rest not in METADATA_FIELDS)):
                raise errors.TASK_INVALID(f"update_mask: {path!r} is not a field that can change")
        # A compare-and-set on the revision read: a change in between makes it read and merge again.
        for _ in range(UPDATE_RETRIES):
            task = await self.store.get(task_id, agent)
            if task is None:
                raise _not_found(task_id)
            if request.expected_revision and task.revision != request.expected_revision:
                raise errors.TASK_REVISION_CHANGED(
                    f"task {task_id} is at revision {task.revision}, not {request.expected_revision}"
                )
            updated = await self.store.update(self._merged(task, request.task, set(paths)))
            if updated is not None:
                self.engine.wake()
                return scheduler_pb2.UpdateTaskResponse(task=convert.task_to_proto(updated))
            if request.expected_revision:
                break
        raise errors.TASK_REVISION_CHANGED(
            f"task {task_id} kept changing while it was updated", hint="retry the update"
        )

    def _merged(self, task: domain.Task, spec: scheduler_pb2.TaskSpec, paths: set[str]) -> domain.TaskEdit:
        """The task after the masked fields of ``spec`` replace it, validated as a whole."""

        def changes(name: str) -> bool:
            return f"metadata.{name}" in paths or "metadata" in paths

        given = convert.metadata_input(spec.metadata)
        overrides = {name: getattr(given, name) for name in METADATA_FIELDS - {"values"} if changes(name)}
        meta = replace(domain.MetadataInput.of(task.schedule), **overrides)
        tags = domain.validate_tags(list(spec.tags)) if "tags" in paths else task.tags
        repeat = domain.REPEAT_TAG in tags
        schedule = domain.validate_schedule(meta, repeat=repeat)
        due_at = convert.optional_moment(spec, "due_at", "due_at") if "due_at" in paths else task.due_at
        values = (
            domain.validate_values(convert.values_of(spec.metadata)) if changes("values") else task.values
        )
        next_run_at = task.next_run_at
        if bool({"due_at", "tags", "metadata"} & paths) or any(
            changes(name) for name in ("update_interval_ms", "cron", "scheduled_at", "not_before_ms")
        ):
            next_run_at = rules.rescheduled(
                task,
                schedule,
                repeat=repeat,
                due_at=due_at,
                due_changed="due_at" in paths,
                now=datetime.now(UTC),
            )

        def uuid_field(name: str, stored: uuid.UUID | None) -> uuid.UUID | None:
            return domain.optional_uuid(getattr(spec, name), name) if name in paths else stored

        return domain.TaskEdit(
            id=task.id,
            revision=task.revision,
            description=domain.validate_description(spec.description)
            if "description" in paths
            else task.description,
            tags=tags,
            room_id=uuid_field("room_id", task.room_id),
            world_id=uuid_field("world_id", task.world_id),
            entity_id=uuid_field("entity_id", task.entity_id),
            due_at=due_at,
            schedule=schedule,
            values=values,
            next_run_at=next_run_at,
            ready_at=rules.ready_at(next_run_at, schedule, repeat=repeat),
        )

    async def DeleteTask(self, request: scheduler_pb2.DeleteTaskRequest) -> scheduler_pb2.DeleteTaskResponse:
        task_id = _task_id(request.id)
        deleted = await self.store.delete(task_id, _agent(request.agent_id))
        if deleted is None:
            raise _not_found(task_id)
        log.info("task deleted", task_id=str(task_id), worker=deleted.name)
        return scheduler_pb2.DeleteTaskResponse(task=convert.task_to_proto(deleted))

    async def PauseTask(self, request: scheduler_pb2.PauseTaskRequest) -> scheduler_pb2.PauseTaskResponse:
        task_id = _task_id(request.id)
        agent = _agent(request.agent_id)
        paused = await self.store.pause(task_id, agent)
        if paused is None:
            current = await self.store.get(task_id, agent)
            if current is None:
                raise _not_found(task_id)
            if current.status is domain.Status.FAILED:
                raise errors.TASK_FAILED(f"task {task_id} failed; there is nothing to pause")
            return scheduler_pb2.PauseTaskResponse(task=convert.task_to_proto(current))
        self.metrics.paused.labels(domain.PauseReason.OPERATOR.value).inc()
        log.info("task paused", task_id=str(task_id), worker=paused.name, reason="operator")
        return scheduler_pb2.PauseTaskResponse(task=convert.task_to_proto(paused))

    async def ResumeTask(self, request: scheduler_pb2.ResumeTaskRequest) -> scheduler_pb2.ResumeTaskResponse:
        task_id = _task_id(request.id)
        agent = _agent(request.agent_id)
        resumed = await self.store.resume(task_id, agent, now=request.run_immediately)
        if resumed is None and request.run_immediately:
            resumed = await self.store.run_soon(task_id, agent)
        if resumed is None:
            current = await self.store.get(task_id, agent)
            if current is None:
                raise _not_found(task_id)
            if current.status is domain.Status.RUNNING or not request.run_immediately:
                return scheduler_pb2.ResumeTaskResponse(task=convert.task_to_proto(current))
            raise errors.TASK_NOT_PAUSED(f"task {task_id} cannot be resumed")
        log.info("task resumed", task_id=str(task_id), worker=resumed.name, now=request.run_immediately)
        if request.run_immediately and (not resumed.queued or not self.claim_loop):
            # Nothing polls this task: run it here, without making the caller wait for the run.
            background = asyncio.create_task(self._execute_in_background(task_id, agent))
            self._background.add(background)
            background.add_done_callback(self._background.discard)
        self.engine.wake()
        return scheduler_pb2.ResumeTaskResponse(task=convert.task_to_proto(resumed))

    # --- running ----------------------------------------------------------------------------

    async def _execute(self, task_id: uuid.UUID, agent: uuid.UUID | None) -> domain.RunReport:
        cfg = self.engine.config
        claimed = await self.store.claim_one(task_id, agent, cfg.owner, cfg.lease_ms)
        if claimed is None:
            current = await self.store.get(task_id, agent)
            if current is None:
                raise _not_found(task_id)
            self.metrics.conflicts.inc()
            holder = current.lease.owner if current.lease else None
            raise errors.TASK_RUNNING(f"task {task_id} is running (lease held by {holder})")
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
        return scheduler_pb2.ExecuteTaskResponse(run=convert.run_to_proto(report))

    async def RunDueTasks(
        self, request: scheduler_pb2.RunDueTasksRequest
    ) -> scheduler_pb2.RunDueTasksResponse:
        limit = request.limit or DEFAULT_DUE_LIMIT
        if not 1 <= limit <= MAX_BATCH:
            raise errors.INVALID_LIMIT(f"limit must be from 1 to {MAX_BATCH}")
        cfg = self.engine.config
        claimed = await self.store.claim_due(cfg.owner, cfg.lease_ms, limit)
        for task in claimed:
            if task.reclaimed:
                self.metrics.lease_expired.inc()
        runs = [self.engine.spawn(task) for task in claimed]
        reports = await asyncio.shield(asyncio.gather(*runs)) if runs else []
        return scheduler_pb2.RunDueTasksResponse(runs=[convert.run_to_proto(r) for r in reports])

    async def RegisterWorker(
        self, request: scheduler_pb2.RegisterWorkerRequest
    ) -> scheduler_pb2.RegisterWorkerResponse:
        name = domain.validate_name(request.name)
        service = request.service.strip()
        if not service or len(service) > 100:
            raise domain.invalid("service", "must be 1-100 characters")
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
