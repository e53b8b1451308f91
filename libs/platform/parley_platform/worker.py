"""Workers: how a service runs the scheduler's tasks.

The scheduler owns *when* a task runs; a worker owns *what* runs. A service
registers handlers by worker name and serves them with a ``WorkerHost``::

    from parley_platform.worker import TaskFailed, TaskResult, WorkerHost, worker

    @worker("BATCHER_DRAIN")
    async def drain(task, lease):
        drained = await drain_sections(task.agent_id, task.values)
        if drained is None:
            raise TaskFailed("model unavailable", retry_at=soon)
        return TaskResult(next_interval_ms=500 if drained else 5000)

    host = WorkerHost(bus, service="runtime")
    await host.start()          # serves <ns>.tasks.run.BATCHER_DRAIN in the queue group `tasks`
    ...
    await host.stop()

A handler receives the ``Task`` and its ``Lease`` and returns ``None`` or a
``TaskResult``: ``next_interval_ms`` adapts a repeat task's interval,
``preserve`` keeps the task exactly as it was (a one-shot is not deleted).
Raising ``TaskFailed`` (optionally with ``retry_at``) or any other exception
reports a failure; the scheduler applies its backoff and pause rules.

While a handler runs, the host tells the dispatching scheduler every third of
the lease that the run goes on, so long work keeps its lease. If the scheduler
answers that the lease is lost (the task was deleted, or another attempt took
it over), the handler is cancelled and nothing is reported: a late result would
be rejected anyway.

The scheduler sends the runs of one worker name that it dispatches together as
one batch (``RunTaskBatch``, header ``Parley-Batch``); the host runs each on its
own and answers them as they end, those that end together in one message. A
request of one run (``RunTaskRequest``) is served too.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import traceback
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import nats.errors
from google.protobuf import json_format
from google.protobuf.message import DecodeError
from nats.aio.msg import Msg
from prometheus_client import CollectorRegistry, Counter, Histogram

from parley.v1 import scheduler_pb2
from parley.v1.scheduler_nats import SchedulerClient

from . import codes
from .bus import Bus, Subjects
from .convert import datetime_of
from .deadlines import Deadlines
from .errors import ParleyError
from .logging import get_logger
from .metrics import LATENCY_BUCKETS
from .permissions import MAX_BATCH_RUNS  # a batch's most runs, as many as a worker may answer
from .rpc import RpcClient

log = get_logger(__name__)

QUEUE_GROUP = "tasks"
PROBE_HEADER = "Parley-Probe"
# A worker's reply says ok or error (a parley.v1.Error) in this header.
STATUS = "Parley-Status"
# A request carrying a RunTaskBatch (several runs) instead of one RunTaskRequest.
BATCH_HEADER = "Parley-Batch"
MAX_ERROR_CHARS = 2000


def run_subject(subjects: Subjects, name: str) -> str:
    """The subject a worker name is served on: ``<ns>.tasks.run.<name>``."""
    return f"{subjects.ns}.tasks.run.{name}"


@dataclass(frozen=True)
class Task:
    """The task a handler runs (ids are strings; empty optional ids are None)."""

    id: str
    agent_id: str
    name: str
    description: str
    tags: tuple[str, ...]
    room_id: str | None
    world_id: str | None
    entity_id: str | None
    values: dict[str, Any]
    due_at: datetime | None
    last_run_at: datetime | None
    failure_count: int
    update_interval_ms: float | None
    proto: scheduler_pb2.Task = field(repr=False)

    @property
    def repeat(self) -> bool:
        return "repeat" in self.tags

    @classmethod
    def from_proto(cls, task: scheduler_pb2.Task) -> Task:
        meta = task.metadata
        return cls(
            id=task.id,
            agent_id=task.agent_id,
            name=task.name,
            description=task.description,
            tags=tuple(task.tags),
            room_id=task.room_id or None,
            world_id=task.world_id or None,
            entity_id=task.entity_id or None,
            values=json_format.MessageToDict(meta.values) if meta.HasField("values") else {},
            due_at=datetime_of(task.due_at),
            last_run_at=datetime_of(task.last_run_at),
            failure_count=task.failure_count,
            update_interval_ms=meta.update_interval_ms if meta.HasField("update_interval_ms") else None,
            proto=task,
        )


@dataclass
class Lease:
    """The claim a run holds. ``attempt`` > 1 means an earlier attempt of this slot was lost
    (it may or may not have run), so a handler with side effects should check before repeating them."""

    token: int
    owner: str
    attempt: int
    expires_at: datetime | None
    deadline: datetime | None
    _lost: bool = False

    @property
    def lost(self) -> bool:
        return self._lost


@dataclass(frozen=True)
class TaskResult:
    next_interval_ms: float | None = None
    preserve: bool = False


class TaskFailed(Exception):
    """The run failed; ``retry_at`` asks the scheduler not to run it again before then."""

    def __init__(self, message: str, *, retry_at: datetime | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.retry_at = retry_at


Handler = Callable[[Task, Lease], Awaitable[TaskResult | None]]


class Workers:
    """Handlers by worker name. ``worker(name)`` registers into the default instance."""

    def __init__(self) -> None:
        self._handlers: dict[str, Handler] = {}

    def worker(self, name: str) -> Callable[[Handler], Handler]:
        def register(handler: Handler) -> Handler:
            self.add(name, handler)
            return handler

        return register

    def add(self, name: str, handler: Handler) -> None:
        if not name or any(c in name for c in ".*> \t\r\n"):
            raise codes.WORKER_NAME_INVALID(f"worker name {name!r} cannot be a NATS subject token")
        if name in self._handlers and self._handlers[name] is not handler:
            raise codes.WORKER_DUPLICATE(f"worker {name!r} is registered twice")
        self._handlers[name] = handler

    def get(self, name: str) -> Handler | None:
        return self._handlers.get(name)

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self._handlers))

    def __len__(self) -> int:
        return len(self._handlers)


WORKERS = Workers()


def worker(name: str) -> Callable[[Handler], Handler]:
    """Register a handler for the worker ``name`` in the default registry."""
    return WORKERS.worker(name)


class WorkerMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.runs = Counter(
            "parley_worker_runs_total",
            "Task runs handled by this worker",
            ["worker", "outcome"],
            registry=registry,
        )
        self.duration = Histogram(
            "parley_worker_run_duration_seconds",
            "Time a worker spent on one task run",
            ["worker"],
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )


class WorkerHost:
    """Serves every registered worker name of a service on ``<ns>.tasks.run.<name>``."""

    def __init__(
        self,
        bus: Bus,
        *,
        service: str,
        workers: Workers | None = None,
        concurrency: int = 64,
        registry: CollectorRegistry | None = None,
        announce_timeout: float = 2.0,
    ) -> None:
        self.bus = bus
        self.service = service
        self.workers = workers if workers is not None else WORKERS
        self.metrics = WorkerMetrics(registry) if registry is not None else None
        self.announce_timeout = announce_timeout
        self._slots = asyncio.Semaphore(concurrency)
        # The runs' deadlines, checked by one timer (``Deadlines``: not one per run).
        self._deadlines = Deadlines()
        self._subs: list[Any] = []
        self._runs: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        for name in self.workers:
            subject = run_subject(self.bus.subjects, name)
            self._subs.append(await self.bus.subscribe(subject, self._on_message, queue=QUEUE_GROUP))
        if self._subs:
            log.info("workers serving", service=self.service, workers=",".join(self.workers))
            await self.announce()

    async def announce(self) -> None:
        """Tell the scheduler these workers exist, so orphaned tasks resume at once.

        Best effort: the scheduler also finds workers by probing their subjects."""
        scheduler = SchedulerClient(RpcClient(self.bus), timeout=self.announce_timeout)
        for name in self.workers:
            try:
                await scheduler.RegisterWorker(
                    scheduler_pb2.RegisterWorkerRequest(name=name, service=self.service)
                )
            except ParleyError as exc:
                log.info("scheduler not told about worker", worker=name, error=exc.code)
                return

    async def _on_message(self, msg: Msg) -> None:
        # Callbacks of one subscription run one at a time: start the runs and return, so the
        # heartbeat of a run waiting for a free slot starts at once too.
        headers = msg.headers or {}
        if headers.get(PROBE_HEADER):
            await self._respond(msg, b"", "ok")
            return
        if not headers.get(BATCH_HEADER):
            self._start(self._serve(msg))
            return
        try:
            batch = scheduler_pb2.RunTaskBatch.FromString(msg.data)
        except DecodeError:
            error = codes.INVALID_PAYLOAD("the request is not a RunTaskBatch")
            await self._respond(msg, error.to_proto().SerializeToString(), "error")
            return
        if len(batch.runs) > MAX_BATCH_RUNS:
            error = codes.INVALID_PAYLOAD(
                f"a batch holds at most {MAX_BATCH_RUNS} runs, not {len(batch.runs)}"
            )
            await self._respond(msg, error.to_proto().SerializeToString(), "error")
            return
        replies = _Replies(self.bus, msg.reply, spawn=self._start)
        default = msg.subject.rsplit(".", 1)[-1]
        for index, request in enumerate(batch.runs):
            self._start(self._serve_in_batch(replies, index, request, default))

    def _start(self, coro: Coroutine[Any, Any, None]) -> None:
        run = asyncio.create_task(coro)
        self._runs.add(run)
        run.add_done_callback(self._runs.discard)

    async def _respond(self, msg: Msg, data: bytes, status: str) -> None:
        if msg.reply:
            with contextlib.suppress(nats.errors.Error):
                await self.bus.nc.publish(msg.reply, data, headers={STATUS: status})

    async def _serve(self, msg: Msg) -> None:
        """A request of one run: answered with its ``RunTaskResponse`` or a ``parley.v1.Error``."""
        try:
            request = scheduler_pb2.RunTaskRequest.FromString(msg.data)
        except DecodeError:
            error = codes.INVALID_PAYLOAD("the request is not a RunTaskRequest")
            await self._respond(msg, error.to_proto().SerializeToString(), "error")
            return
        outcome = await self._execute(request, msg.subject.rsplit(".", 1)[-1])
        if isinstance(outcome, ParleyError):
            await self._respond(msg, outcome.to_proto().SerializeToString(), "error")
        elif outcome is not None:
            await self._respond(msg, outcome.SerializeToString(), "ok")

    async def _serve_in_batch(
        self, replies: _Replies, index: int, request: scheduler_pb2.RunTaskRequest, default: str
    ) -> None:
        outcome = await self._execute(request, default)
        if outcome is not None:
            replies.add(index, outcome)

    async def _execute(
        self, request: scheduler_pb2.RunTaskRequest, default: str
    ) -> scheduler_pb2.RunTaskResponse | ParleyError | None:
        """Run one task: its response, an error when it cannot run here, or None when its lease was
        lost (nothing is reported: a late result would be rejected anyway)."""
        name = request.task.name or default
        handler = self.workers.get(name)
        if handler is None:
            return codes.WORKER_UNKNOWN(f"this service has no worker {name!r}")
        lease = Lease(
            token=request.lease.token,
            owner=request.lease.owner,
            attempt=request.lease.attempt,
            expires_at=datetime_of(request.lease.expires_at),
            deadline=datetime_of(request.lease.deadline),
        )
        me = asyncio.current_task()
        assert me is not None
        # Most runs end long before their first heartbeat is due: a timer, not a task, until then.
        beating: list[asyncio.Task[None]] = []
        first_beat = None
        if request.heartbeat_subject and request.lease_ms > 0:
            first_beat = asyncio.get_running_loop().call_later(
                request.lease_ms / 3000,
                lambda: beating.append(asyncio.create_task(self._heartbeat(request, lease, me))),
            )
        started = time.perf_counter()
        outcome = "succeeded"
        response = scheduler_pb2.RunTaskResponse()
        try:
            async with self._slots:
                result = await self._run(handler, Task.from_proto(request.task), lease)
            if result is not None:
                if result.next_interval_ms is not None:
                    response.next_interval_ms = float(result.next_interval_ms)
                response.preserve = result.preserve
        except asyncio.CancelledError:
            if not lease.lost:
                raise
            log.warning("task lease lost, run abandoned", worker=name, task_id=request.task.id)
            if self.metrics:
                self.metrics.runs.labels(name, "lost").inc()
            return None
        except TaskFailed as exc:
            outcome = "failed"
            response.failed, response.error = True, _clip(exc.message)
            if exc.retry_at is not None:
                response.retry_at.FromDatetime(exc.retry_at.astimezone(UTC))
        except TimeoutError:
            outcome = "failed"
            response.failed, response.error = True, "TASK_DEADLINE_EXCEEDED: the run did not finish in time"
        except ParleyError as exc:
            outcome = "failed"
            response.failed, response.error = True, _clip(str(exc))
        except Exception as exc:
            outcome = "failed"
            log.error(
                "task handler crashed",
                worker=name,
                task_id=request.task.id,
                error=type(exc).__name__,
                trace=traceback.format_exc(limit=5),
            )
            response.failed, response.error = True, _clip(f"{type(exc).__name__}: {exc}")
        finally:
            if first_beat is not None:
                first_beat.cancel()
            for heartbeat in beating:
                heartbeat.cancel()
            if self.metrics:
                self.metrics.duration.labels(name).observe(time.perf_counter() - started)
        if self.metrics:
            self.metrics.runs.labels(name, outcome).inc()
        return response

    async def _run(self, handler: Handler, task: Task, lease: Lease) -> TaskResult | None:
        if lease.deadline is None:
            return await handler(task, lease)
        remaining = (lease.deadline - datetime.now(UTC)).total_seconds()
        if remaining <= 0:
            raise TimeoutError
        return await self._deadlines.within(remaining, handler(task, lease))

    async def _heartbeat(
        self, request: scheduler_pb2.RunTaskRequest, lease: Lease, run: asyncio.Task[Any]
    ) -> None:
        """Every third of the lease (the first beat is due when this starts), until cancelled."""
        period = request.lease_ms / 3000
        beat = scheduler_pb2.TaskHeartbeat(task_id=request.task.id, lease_token=request.lease.token)
        payload = beat.SerializeToString()
        while True:
            try:
                reply = await self.bus.nc.request(request.heartbeat_subject, payload, timeout=period)
                answer = scheduler_pb2.TaskHeartbeatResponse.FromString(reply.data)
            except nats.errors.NoRespondersError:
                # The dispatching scheduler is gone; its lease will expire and another attempt
                # will run, so this one's result could not be recorded.
                answer = scheduler_pb2.TaskHeartbeatResponse(held=False)
            except (TimeoutError, nats.errors.Error, DecodeError):
                await asyncio.sleep(period)
                continue
            if answer.HasField("expires_at"):
                lease.expires_at = answer.expires_at.ToDatetime(tzinfo=UTC)
            if not answer.held:
                lease._lost = True
                run.cancel()
                return
            await asyncio.sleep(period)

    async def stop(self, timeout: float = 10.0) -> None:
        """Stop taking runs, let running ones finish for up to ``timeout``, then cancel them
        (unanswered, so the scheduler counts them as uncertain and runs them again)."""
        subs, self._subs = self._subs, []
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                await asyncio.gather(*(sub.drain() for sub in subs), return_exceptions=True)
        if self._runs:
            _, pending = await asyncio.wait(set(self._runs), timeout=timeout)
            for run in pending:
                run.cancel()
            if pending:
                await asyncio.wait(pending, timeout=1)


class _Replies:
    """The replies of one batch: the runs that end in the same turn of the event loop are answered
    in one message on the batch's reply subject."""

    def __init__(self, bus: Bus, subject: str, *, spawn: Callable[[Coroutine[Any, Any, None]], None]) -> None:
        self.bus = bus
        self.subject = subject
        self.spawn = spawn  # the host's: stopping waits for the replies being sent
        self._pending: scheduler_pb2.RunTaskReplies | None = None

    def add(self, index: int, outcome: scheduler_pb2.RunTaskResponse | ParleyError) -> None:
        if not self.subject:
            return
        if self._pending is None:
            self._pending = scheduler_pb2.RunTaskReplies()
            asyncio.get_running_loop().call_soon(self._send)
        reply = self._pending.replies.add(index=index)
        if isinstance(outcome, ParleyError):
            reply.error.CopyFrom(outcome.to_proto())
        else:
            reply.response.CopyFrom(outcome)

    def _send(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            self.spawn(self._publish(pending.SerializeToString()))

    async def _publish(self, data: bytes) -> None:
        with contextlib.suppress(nats.errors.Error):
            await self.bus.nc.publish(self.subject, data, headers={STATUS: "ok"})


def _clip(text: str) -> str:
    return text if len(text) <= MAX_ERROR_CHARS else text[: MAX_ERROR_CHARS - 1] + "…"
