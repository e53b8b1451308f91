"""The claim loop and dispatch: claim due tasks in batches, run each on its worker, complete it.

One replica's moving parts:

- the **claim loop** takes a batch of due tasks in one SKIP LOCKED statement
  and sleeps until the next due time, a NOTIFY from the database, or the poll
  interval, whichever comes first (an idle queue costs one query per interval);
- each claimed task is **dispatched** as a NATS request to its worker, with
  the lease token and a deadline; the worker heartbeats to this replica, which
  extends the lease, and a worker silent for a whole lease gives the lease up
  so the slot is claimed again as the next attempt;
- a **non-blocking** repeat task's runs may overlap: each claimed slot is a run
  with a lease of its own, and its claimer sets the task's next slot before it
  dispatches the run, so the next slot is claimed when it comes due;
- the **completer** writes the outcomes of many runs in one statement, each
  fenced by its lease token (group commit); a non-blocking task's run completes
  on its own, a compare-and-set against the other runs' completions;
- **maintenance** refreshes the due gauge, prunes uncertain attempts past their retention and
  resumes orphaned tasks whose worker is back.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import secrets
import socket
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import UTC, timedelta
from typing import Any

import nats.errors
import psycopg
from google.protobuf.message import DecodeError
from nats.aio.msg import Msg
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from parley.v1 import common_pb2, scheduler_pb2
from parley_platform.bus import Bus
from parley_platform.errors import ParleyError
from parley_platform.logging import get_logger
from parley_platform.metrics import LATENCY_BUCKETS
from parley_platform.rpc import STATUS
from parley_platform.worker import PROBE_HEADER, run_subject

from . import domain
from .convert import OUTCOME_VALUES, task_of
from .store import NOTIFY_CHANNEL, Claimed, SchedulerStore, completion_row, run_completion_row, state_of

log = get_logger(__name__)

LAG_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)
# How long a reply may take to arrive after the worker's own deadline cancelled the run.
REPLY_MARGIN_SECONDS = 2.0
# Completions of one non-blocking task's runs racing each other: each lost race means another won.
FINISH_RUN_TRIES = 20

# A run's outcome as a function of the task's state: a non-blocking task's runs complete
# concurrently, so the outcome may have to be computed again from the task as it is then.
Decision = Callable[[domain.TaskState], domain.Completion]


def default_replica_name() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"


class SchedulerMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.executed = Counter(
            "parley_tasks_executed_total",
            "Task runs by worker and outcome",
            ["worker", "outcome"],
            registry=registry,
        )
        self.duration = Histogram(
            "parley_task_duration_seconds",
            "Dispatch to reply of one run",
            ["worker"],
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.lag = Histogram(
            "parley_task_lag_seconds", "From due to start of a run", buckets=LAG_BUCKETS, registry=registry
        )
        self.due = Gauge("parley_tasks_due", "Queue tasks due and not yet claimed", registry=registry)
        self.paused = Counter(
            "parley_tasks_paused_total", "Tasks paused, by reason", ["reason"], registry=registry
        )
        self.conflicts = Counter(
            "parley_task_claim_conflicts_total",
            "Claims and completions that lost to another holder of the task",
            registry=registry,
        )
        self.lease_expired = Counter(
            "parley_task_lease_expired_total",
            "Runs whose lease expired and whose slot was claimed again",
            registry=registry,
        )
        self.overdue = Counter(
            "parley_tasks_overdue_total",
            "Repeat runs that started after their slot",
            ["worker"],
            registry=registry,
        )
        self.inflight = Gauge("parley_tasks_inflight", "Runs this replica is waiting on", registry=registry)


@dataclass(frozen=True)
class EngineConfig:
    owner: str
    lease_ms: int
    timeout_ms: int
    batch_size: int
    max_inflight: int
    poll_interval: float
    no_worker_grace: float
    no_worker_retry_ms: int
    maintenance_interval: float
    uncertain_retention_ms: int = 30 * 86_400_000


@dataclass
class Inflight:
    task_id: str
    token: int
    deadline: float  # monotonic: the worker must be heard of before this
    lost: bool = False


@dataclass
class Report:
    """What happened to one run."""

    task_id: str
    name: str
    attempt: int
    outcome: domain.Outcome
    error: str = ""
    duration_ms: float = 0.0
    deleted: bool = False

    def to_proto(self) -> scheduler_pb2.TaskRun:
        return scheduler_pb2.TaskRun(
            task_id=self.task_id,
            name=self.name,
            attempt=self.attempt,
            outcome=OUTCOME_VALUES[self.outcome],
            error=self.error,
            duration_ms=self.duration_ms,
            deleted=self.deleted,
        )


class _Slot:
    """One of a replica's dispatch slots, held from the claim until the worker answers."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.held = True
        engine._occupy()

    def release(self) -> None:
        if self.held:
            self.held = False
            self.engine._vacate()


class WorkerSilent(Exception):
    """No reply and no heartbeat within a lease: the run's fate is unknown."""


@dataclass
class _Pending:
    claimed: Claimed
    completion: domain.Completion
    done: asyncio.Future[tuple[bool, bool]] = field(repr=False)


class Completer:
    """Group commit of completions: whatever piled up while one batch was written goes in the next."""

    def __init__(self, store: SchedulerStore, max_batch: int = 1000) -> None:
        self.store = store
        self.max_batch = max_batch
        self._pending: list[_Pending] = []
        self._ready = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._closing = False

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="scheduler-completer")

    async def complete(self, claimed: Claimed, completion: domain.Completion) -> tuple[bool, bool]:
        """Write one outcome; returns (applied, deleted). Not applied: the lease was lost."""
        future: asyncio.Future[tuple[bool, bool]] = asyncio.get_running_loop().create_future()
        self._pending.append(_Pending(claimed, completion, future))
        self._ready.set()
        return await future

    async def _loop(self) -> None:
        while True:
            await self._ready.wait()
            self._ready.clear()
            while self._pending:
                batch, self._pending = self._pending[: self.max_batch], self._pending[self.max_batch :]
                try:
                    await self._write(batch)
                except Exception as exc:
                    # Never leave a run waiting forever: its lease expires and the slot runs again.
                    log.exception("completions failed", runs=len(batch))
                    for p in batch:
                        if not p.done.done():
                            p.done.set_exception(exc)
            if self._closing:
                return

    async def _write(self, batch: list[_Pending]) -> None:
        deletes = [(p.claimed.id, p.claimed.token) for p in batch if p.completion.delete]
        updates = [completion_row(p.claimed, p.completion) for p in batch if not p.completion.delete]
        for attempt in range(4):
            try:
                applied = await self.store.finish(deletes, updates)
                break
            except ParleyError as exc:
                if attempt == 3 or not exc.retryable:
                    log.error("completions not written", error=str(exc), runs=len(batch))
                    for p in batch:
                        if not p.done.done():
                            p.done.set_exception(exc)
                    return
                await asyncio.sleep(0.05 * 2**attempt)
        for p in batch:
            key = str(p.claimed.id)
            if not p.done.done():
                p.done.set_result((key in applied, applied.get(key, False)))

    async def close(self, timeout: float) -> None:
        self._closing = True
        self._ready.set()
        if self._task is not None:
            with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
                await asyncio.wait_for(self._task, timeout)


class Engine:
    def __init__(
        self,
        *,
        store: SchedulerStore,
        bus: Bus,
        config: EngineConfig,
        metrics: SchedulerMetrics,
        database_url: str,
        claim_loop: bool = True,
    ) -> None:
        self.store = store
        self.bus = bus
        self.config = config
        self.metrics = metrics
        self.database_url = database_url
        self.claim_loop = claim_loop  # False in serverless mode: RunDueTasks claims instead
        self.completer = Completer(store)
        self.inflight: dict[int, Inflight] = {}  # by lease token: runs of one task may overlap
        self.heartbeat_subject = f"{bus.subjects.ns}.scheduler.heartbeat.{secrets.token_hex(8)}"
        self.started = time.monotonic()
        self._wake = asyncio.Event()
        self._slot_freed = asyncio.Event()
        self._busy = 0
        self._stopping = asyncio.Event()
        self._loops: list[asyncio.Task[None]] = []
        self._runs: set[asyncio.Task[Any]] = set()
        self._heartbeat_sub: Any = None
        self._listening = False

    # --- life cycle -------------------------------------------------------------------------

    async def start(self) -> None:
        claim_loop = self.claim_loop
        self.started = time.monotonic()
        self.completer.start()
        self._heartbeat_sub = await self.bus.subscribe(self.heartbeat_subject, self._on_heartbeat)
        self._loops.append(asyncio.create_task(self._maintenance(), name="scheduler-maintenance"))
        if claim_loop:
            self._loops.append(asyncio.create_task(self._listen(), name="scheduler-listen"))
            self._loops.append(asyncio.create_task(self._claim_loop(), name="scheduler-claim"))

    async def stop(self, timeout: float) -> None:
        """Stop claiming, let runs in flight finish for up to ``timeout``, give up the rest's leases."""
        self._stopping.set()
        self._wake.set()
        for loop in self._loops:
            loop.cancel()
        await asyncio.gather(*self._loops, return_exceptions=True)
        if self._runs:
            _, pending = await asyncio.wait(set(self._runs), timeout=timeout)
            abandoned = dict(self.inflight)
            for run in pending:
                run.cancel()
            if pending:
                await asyncio.wait(pending, timeout=2)
            # Give the leases of cut-off runs back now rather than at their expiry, so another
            # replica takes them over (as the next attempt) at once.
            for entry in abandoned.values():
                with contextlib.suppress(ParleyError, ValueError):
                    await self.store.release_lease(
                        uuid.UUID(entry.task_id),
                        entry.token,
                        "the scheduler stopped during the run; its outcome is unknown",
                    )
        await self.completer.close(timeout=5)
        if self._heartbeat_sub is not None:
            with contextlib.suppress(nats.errors.Error):
                await self._heartbeat_sub.unsubscribe()

    def spawn(self, claimed: Claimed) -> asyncio.Task[Report]:
        slot = _Slot(self)
        run = asyncio.create_task(self.run(claimed, slot))
        self._runs.add(run)

        def done(task: asyncio.Task[Report]) -> None:
            self._runs.discard(task)
            slot.release()

        run.add_done_callback(done)
        return run

    def _occupy(self) -> None:
        self._busy += 1
        self.metrics.inflight.set(self._busy)

    def _vacate(self) -> None:
        self._busy -= 1
        self.metrics.inflight.set(self._busy)
        self._slot_freed.set()

    # --- the claim loop ---------------------------------------------------------------------

    async def _claim_loop(self) -> None:
        cfg = self.config
        failures = 0
        # Near capacity, wait until a useful batch can be claimed rather than claiming the
        # slots one by one as they free up: a claim costs a statement however few rows it takes.
        worth_claiming = max(1, min(cfg.batch_size, cfg.max_inflight // 4))
        while not self._stopping.is_set():
            free = cfg.max_inflight - self._busy
            if free <= 0 or (free < worth_claiming and self._busy > 0):
                self._slot_freed.clear()
                await self._slot_freed.wait()
                continue
            limit = min(cfg.batch_size, free)
            self._wake.clear()
            try:
                batch = await self.store.claim_due(cfg.owner, cfg.lease_ms, limit)
                failures = 0
            except Exception as exc:
                # The loop outlives any failure: a database outage, or a bug, is retried with backoff.
                failures += 1
                if isinstance(exc, ParleyError):
                    log.warning("claim failed", error=str(exc), attempt=failures)
                else:
                    log.exception("claim crashed", attempt=failures)
                await self._sleep(min(cfg.poll_interval, 0.1 * 2 ** min(failures, 6)))
                continue
            for claimed in batch:
                if claimed.reclaimed:
                    self.metrics.lease_expired.inc()
                self.spawn(claimed)
            if len(batch) >= limit:
                continue
            try:
                at, db_now = await self.store.next_wakeup()
            except ParleyError as exc:
                log.warning("next wake-up unknown", error=str(exc))
                at, db_now = None, None
            delay = cfg.poll_interval
            if at is not None and db_now is not None:
                delay = min(cfg.poll_interval, (at - db_now).total_seconds())
            if delay <= 0:
                if batch:
                    continue
                # Due but locked by another replica's claim: look again shortly.
                delay = 0.01
            await self._sleep(delay)

    async def _sleep(self, seconds: float) -> None:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(seconds):
                await self._wake.wait()

    def wake(self) -> None:
        self._wake.set()

    async def _listen(self) -> None:
        """LISTEN for the trigger's hint that something became due; reconnect when the connection drops."""
        while not self._stopping.is_set():
            try:
                async with await psycopg.AsyncConnection.connect(
                    self.database_url, autocommit=True, application_name="scheduler-listen"
                ) as conn:
                    await conn.execute(f"LISTEN {NOTIFY_CHANNEL}")
                    self._listening = True
                    # Anything that became due while we were not listening.
                    self._wake.set()
                    async for _ in conn.notifies():
                        self._wake.set()
            except psycopg.Error as exc:
                log.warning("listen connection lost, polling meanwhile", error=type(exc).__name__)
            self._listening = False
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(1.0):
                    await self._stopping.wait()

    # --- one run ----------------------------------------------------------------------------

    async def run(self, claimed: Claimed, slot: _Slot | None = None) -> Report:
        """Dispatch one claimed task to its worker and record the outcome (never raises).

        The dispatch slot is given back as soon as the worker has answered: writing the outcome
        is batched with others' and needs no slot (the lease keeps the task from being claimed)."""
        state = claimed.state
        name = state.name
        started = time.perf_counter()
        lag = (claimed.db_now - claimed.due).total_seconds()
        report = Report(str(claimed.id), name, claimed.attempt, domain.Outcome.SUCCEEDED)
        try:
            if claimed.concurrent and claimed.slot is not None and not await self._advance(claimed):
                # Given up rather than run: whoever takes the lease over sets the slot, then runs it.
                report.outcome = domain.Outcome.UNCERTAIN
                report.error = "the next slot could not be set; the run was not dispatched"
                with contextlib.suppress(ParleyError):
                    await self.store.release_lease(claimed.id, claimed.token, report.error)
                return report
            if domain.is_overdue(state, claimed.db_now):
                self.metrics.overdue.labels(name).inc()
                log.warning(
                    "repeat task overdue",
                    task_id=report.task_id,
                    worker=name,
                    late_seconds=round(lag, 3),
                    missed_run=state.schedule.missed_run.value,
                )
                if state.schedule.missed_run is domain.MissedRun.SKIP:
                    skip = functools.partial(domain.on_skip, now=claimed.db_now)
                    return await self._finish(claimed, skip, report, started)
            self.metrics.lag.observe(max(0.0, lag))
            decide = await self._dispatch(claimed, report)
            if slot is not None:
                slot.release()
            if decide is None:
                report.duration_ms = (time.perf_counter() - started) * 1000
                return report
            return await self._finish(claimed, decide, report, started)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("run failed unexpectedly", task_id=report.task_id, worker=name)
            report.outcome = domain.Outcome.UNCERTAIN
            report.error = "the scheduler failed while running the task; its lease will expire"
            return report
        finally:
            self.metrics.executed.labels(name, report.outcome.value).inc()

    async def _advance(self, claimed: Claimed) -> bool:
        """A non-blocking task's slot was claimed: set its next slot, so that the task is claimed again
        when that comes due, whether or not this run is over. False: the database did not answer; the
        run is not dispatched and its lease is given up (whoever takes it over sets the slot)."""
        assert claimed.slot is not None
        following, ready = domain.slot_after_claim(claimed.state, claimed.db_now)
        for attempt in range(4):
            try:
                # Not applied: the slot was set already (this run was taken over), or an operator moved it.
                await self.store.advance_slot(claimed.id, claimed.slot, following, ready)
                return True
            except ParleyError as exc:
                if attempt == 3 or not exc.retryable:
                    log.warning("next slot not set", task_id=str(claimed.id), error=str(exc))
                    return False
                await asyncio.sleep(0.05 * 2**attempt)
        return False

    async def _dispatch(self, claimed: Claimed, report: Report) -> Decision | None:
        """The run's outcome, or None when it is unknown (the lease was given up or lost)."""
        state = claimed.state
        cfg = self.config
        timeout_ms = state.schedule.timeout_ms or cfg.timeout_ms
        deadline = claimed.db_now + timedelta(milliseconds=timeout_ms)
        request = scheduler_pb2.RunTaskRequest(
            task=task_of(claimed.row, db_now=claimed.db_now),
            heartbeat_subject=self.heartbeat_subject,
            lease_ms=float(cfg.lease_ms),
        )
        lease = request.lease
        lease.owner, lease.token, lease.attempt = cfg.owner, claimed.token, claimed.attempt
        lease.expires_at.FromDatetime(claimed.row["lease_expires_at"])
        lease.deadline.FromDatetime(deadline)
        key = claimed.token
        entry = Inflight(str(claimed.id), claimed.token, time.monotonic() + cfg.lease_ms / 1000)
        self.inflight[key] = entry
        sent = time.perf_counter()
        try:
            reply = await self._request(
                run_subject(self.bus.subjects, state.name),
                request.SerializeToString(),
                entry,
                timeout_ms / 1000 + REPLY_MARGIN_SECONDS,
            )
        except nats.errors.NoRespondersError:
            in_grace = time.monotonic() - self.started < cfg.no_worker_grace
            decide = functools.partial(
                domain.on_no_worker, in_grace=in_grace, retry_ms=cfg.no_worker_retry_ms
            )
            report.error = decide(state).last_error or ""
            if not in_grace:
                log.warning("no worker serves task", task_id=report.task_id, worker=state.name)
            return decide
        except (WorkerSilent, nats.errors.TimeoutError, nats.errors.Error) as exc:
            await self._uncertain(claimed, entry, exc, report)
            return None
        finally:
            self.inflight.pop(key, None)
            self.metrics.duration.labels(state.name).observe(time.perf_counter() - sent)
        return self._outcome(claimed, reply, report)

    async def _request(self, subject: str, payload: bytes, entry: Inflight, timeout: float) -> Msg:
        request = asyncio.ensure_future(self.bus.nc.request(subject, payload, timeout=timeout))
        try:
            while True:
                remaining = entry.deadline - time.monotonic()
                if entry.lost or remaining <= 0:
                    raise WorkerSilent(
                        "lease lost" if entry.lost else "no reply or heartbeat within the lease"
                    )
                done, _ = await asyncio.wait({request}, timeout=remaining)
                if done:
                    return request.result()
        finally:
            if not request.done():
                request.cancel()

    def _outcome(self, claimed: Claimed, reply: Msg, report: Report) -> Decision:
        status = (reply.headers or {}).get(STATUS)
        try:
            if status == "error":
                envelope = common_pb2.Error.FromString(reply.data)
                error = f"{envelope.code}: {envelope.message}"
                report.error = error
                return functools.partial(domain.on_failure, now=claimed.db_now, error=error, retry_at=None)
            result = scheduler_pb2.RunTaskResponse.FromString(reply.data)
        except DecodeError:
            report.error = "the worker's reply does not decode"
            return functools.partial(domain.on_failure, now=claimed.db_now, error=report.error, retry_at=None)
        now = claimed.now()
        if result.failed:
            retry_at = result.retry_at.ToDatetime(tzinfo=UTC) if result.HasField("retry_at") else None
            report.error = result.error
            return functools.partial(domain.on_failure, now=now, error=result.error, retry_at=retry_at)
        next_interval = result.next_interval_ms if result.HasField("next_interval_ms") else None
        return functools.partial(
            domain.on_success, now=now, next_interval_ms=next_interval, preserve=result.preserve
        )

    async def _uncertain(self, claimed: Claimed, entry: Inflight, exc: BaseException, report: Report) -> None:
        """The worker never answered: give the lease up so the slot runs again as the next attempt."""
        if entry.lost:
            self.metrics.conflicts.inc()
            report.outcome = domain.Outcome.LOST
            report.error = "the lease was lost while the task ran"
            return
        cause = (
            "the worker went silent"
            if isinstance(exc, WorkerSilent)
            else f"dispatch failed ({type(exc).__name__})"
        )
        reason = f"attempt {claimed.attempt} uncertain: {cause}"
        try:
            await self.store.release_lease(claimed.id, claimed.token, reason)
        except ParleyError as db_exc:
            log.warning("lease not released, it will expire", task_id=str(claimed.id), error=str(db_exc))
        log.warning("run uncertain", task_id=str(claimed.id), worker=claimed.state.name, reason=reason)
        report.outcome = domain.Outcome.UNCERTAIN
        report.error = reason
        self._wake.set()

    async def _finish(self, claimed: Claimed, decide: Decision, report: Report, started: float) -> Report:
        if claimed.concurrent:
            applied, completion = await self._finish_run(claimed, decide)
            deleted = False
        else:
            completion = decide(claimed.state)
            applied, deleted = await self.completer.complete(claimed, completion)
        report.duration_ms = (time.perf_counter() - started) * 1000
        report.deleted = deleted
        if not applied:
            self.metrics.conflicts.inc()
            report.outcome = domain.Outcome.LOST
            report.error = "the lease was lost before the run completed; its outcome was not recorded"
            log.warning("completion rejected, lease lost", task_id=report.task_id, worker=report.name)
            return report
        report.outcome = completion.outcome
        if completion.status is domain.Status.PAUSED and completion.pause_reason is not None:
            self.metrics.paused.labels(completion.pause_reason.value).inc()
            log.warning(
                "task paused",
                task_id=report.task_id,
                worker=report.name,
                reason=completion.pause_reason.value,
                failures=completion.failure_count,
            )
        return report

    async def _finish_run(self, claimed: Claimed, decide: Decision) -> tuple[bool, domain.Completion]:
        """Complete one run of a non-blocking task: a compare-and-set on the task as the outcome was
        computed from, computed again from the task as it is when another completion came first."""
        state = claimed.state
        for attempt in range(FINISH_RUN_TRIES):
            completion = domain.for_concurrent_run(decide(state))
            try:
                applied, held = await self.store.finish_run(run_completion_row(claimed, state, completion))
            except ParleyError as exc:
                if not exc.retryable or attempt == FINISH_RUN_TRIES - 1:
                    raise
                await asyncio.sleep(0.01 * 2 ** min(attempt, 5))
                continue
            if applied or not held:
                return applied, completion
            row = await self.store.get(claimed.id, None)
            if row is None:
                return False, completion
            state = replace(state_of(row), next_run_at=state.next_run_at)
        log.warning("run completion kept losing to others", task_id=str(claimed.id))
        return False, completion

    # --- heartbeats -------------------------------------------------------------------------

    async def _on_heartbeat(self, msg: Msg) -> None:
        try:
            beat = scheduler_pb2.TaskHeartbeat.FromString(msg.data)
        except DecodeError:
            return
        entry = self.inflight.get(beat.lease_token)
        if entry is None or entry.task_id != beat.task_id or entry.lost:
            await self._answer(msg, scheduler_pb2.TaskHeartbeatResponse(held=False))
            return
        entry.deadline = time.monotonic() + self.config.lease_ms / 1000
        task = asyncio.create_task(self._extend(msg, beat, entry))
        self._runs.add(task)
        task.add_done_callback(self._runs.discard)

    async def _extend(self, msg: Msg, beat: scheduler_pb2.TaskHeartbeat, entry: Inflight) -> None:
        try:
            expires = await self.store.extend_lease(
                uuid.UUID(beat.task_id), beat.lease_token, self.config.lease_ms
            )
        except (ParleyError, ValueError) as exc:
            log.warning("lease not extended", task_id=beat.task_id, error=str(exc))
            await self._answer(msg, scheduler_pb2.TaskHeartbeatResponse(held=True))
            return
        if expires is None:
            entry.lost = True
            self.metrics.conflicts.inc()
            await self._answer(msg, scheduler_pb2.TaskHeartbeatResponse(held=False))
            return
        answer = scheduler_pb2.TaskHeartbeatResponse(held=True)
        answer.expires_at.FromDatetime(expires)
        await self._answer(msg, answer)

    async def _answer(self, msg: Msg, answer: scheduler_pb2.TaskHeartbeatResponse) -> None:
        if msg.reply:
            with contextlib.suppress(nats.errors.Error):
                await self.bus.nc.publish(msg.reply, answer.SerializeToString())

    # --- maintenance ------------------------------------------------------------------------

    async def _maintenance(self) -> None:
        while not self._stopping.is_set():
            try:
                self.metrics.due.set(await self.store.count_due())
                pruned = await self.store.prune_uncertain(self.config.uncertain_retention_ms)
                if pruned:
                    log.info("uncertain attempts past their retention pruned", count=pruned)
                for name in await self.store.orphaned_names():
                    if await self.worker_present(name):
                        resumed = await self.store.resume_orphans(name)
                        if resumed:
                            log.info("orphaned tasks resumed, worker is back", worker=name, tasks=resumed)
                            self._wake.set()
            except ParleyError as exc:
                log.warning("maintenance failed", error=str(exc))
            except Exception:
                log.exception("maintenance crashed")
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.config.maintenance_interval):
                    await self._stopping.wait()

    async def worker_present(self, name: str) -> bool:
        """Whether anyone serves the worker name: a probe request that runs nothing."""
        try:
            await self.bus.nc.request(
                run_subject(self.bus.subjects, name), b"", timeout=1.0, headers={PROBE_HEADER: "1"}
            )
        except nats.errors.NoRespondersError:
            return False
        except (nats.errors.TimeoutError, nats.errors.Error):
            # Someone holds the subject but did not answer in time: busy, not absent.
            return True
        return True
