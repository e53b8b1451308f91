"""One run, from its claim to its outcome: dispatch to the worker, heartbeats, the completion.

Each claimed task is dispatched as a NATS request to its worker, with the lease token and a deadline
(the runs of a claim together, one request per worker name: ``batches``).
The worker heartbeats to this replica, which extends the lease; a worker silent for a whole lease
gives the lease up, so the slot is claimed again as the next attempt. A non-blocking task's claimer
sets the task's next slot before it dispatches the run, so the next slot is claimed when it comes
due; its run completes on its own, a compare-and-set against the other runs' completions. Every
other run's outcome goes to the completer's group commit.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import secrets
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from typing import Any

import nats.errors
from google.protobuf.message import DecodeError
from nats.aio.msg import Msg

from parley.v1 import common_pb2, scheduler_pb2
from parley_platform import codes
from parley_platform.bus import Bus, Inbox
from parley_platform.convert import datetime_of, timestamp
from parley_platform.errors import ParleyError
from parley_platform.logging import get_logger
from parley_platform.retry import Backoff, retrying
from parley_platform.worker import run_subject

from . import domain, rules
from .batches import Reply, RunBatches
from .completer import Completer
from .config import EngineConfig
from .convert import lease_to_proto, task_to_proto
from .metrics import SchedulerMetrics
from .store import Claimed, SchedulerStore, run_completion_row

log = get_logger(__name__)

# How long a reply may take to arrive after the worker's own deadline cancelled the run.
REPLY_MARGIN_SECONDS = 2.0
# Setting a non-blocking task's next slot, before its run is dispatched.
ADVANCE_ATTEMPTS = 4
ADVANCE_BACKOFF = Backoff(base=0.05, cap=0.2)
# Completions of one non-blocking task's runs racing each other: each lost race means another won.
# A lost race is computed again at once; a retryable database error waits its backoff first.
FINISH_RUN_TRIES = 20
FINISH_RUN_BACKOFF = Backoff(base=0.01, cap=0.32)

# A run's outcome as a function of the task's state: a non-blocking task's runs complete
# concurrently, so the outcome may have to be computed again from the task as it is then.
Decision = Callable[[domain.TaskState], domain.Completion]


# How often the runs in flight are looked at for a silent worker or a run past its time.
WATCH_SECONDS = 0.05


@dataclass
class Inflight:
    task_id: str
    token: int
    deadline: float  # loop time: the worker must be heard of before this (a heartbeat moves it)
    gives_up_at: float  # loop time: the run's own timeout and the margin for its reply
    lost: bool = False
    reply: asyncio.Future[Reply] | None = None

    def fail(self, reason: str) -> None:
        """Stop waiting for the worker's reply: its fate is unknown."""
        if self.reply is not None and not self.reply.done():
            self.reply.set_exception(WorkerSilent(reason))


class WorkerSilent(Exception):
    """No reply and no heartbeat within a lease: the run's fate is unknown."""


class Dispatcher:
    """Runs claimed tasks on their workers and records their outcomes."""

    def __init__(
        self,
        *,
        store: SchedulerStore,
        bus: Bus,
        config: EngineConfig,
        metrics: SchedulerMetrics,
        wake: Callable[[], None],
    ) -> None:
        self.store = store
        self.bus = bus
        self.config = config
        self.metrics = metrics
        self.wake = wake  # a lease given up: the claim loop should look again
        self.completer = Completer(store)
        self.inflight: dict[int, Inflight] = {}  # by lease token: runs of one task may overlap
        self.inbox = Inbox(bus)
        self.batches = RunBatches(self.inbox)
        self._watching: asyncio.TimerHandle | None = None
        self.heartbeat_subject = f"{bus.subjects.ns}.scheduler.heartbeat.{secrets.token_hex(8)}"
        self.extending: set[asyncio.Task[None]] = set()
        self.started = time.monotonic()
        self._heartbeat_sub: Any = None

    async def start(self) -> None:
        self.started = time.monotonic()
        self.completer.start()
        await self.inbox.start()
        self._heartbeat_sub = await self.bus.subscribe(self.heartbeat_subject, self._on_heartbeat)

    async def release_abandoned(self, abandoned: list[Inflight]) -> None:
        """Give the leases of cut-off runs back now rather than at their expiry, so another replica
        takes them over (as the next attempt) at once."""
        for entry in abandoned:
            with contextlib.suppress(ParleyError, ValueError):
                await self.store.release_lease(
                    uuid.UUID(entry.task_id),
                    entry.token,
                    "the scheduler stopped during the run; its outcome is unknown",
                )

    async def close(self) -> None:
        await self.completer.close(timeout=5)
        await self.inbox.close()
        if self._watching is not None:
            self._watching.cancel()
        if self._heartbeat_sub is not None:
            with contextlib.suppress(nats.errors.Error):
                await self._heartbeat_sub.unsubscribe()

    # --- one run ----------------------------------------------------------------------------

    async def run(self, claimed: Claimed, answered: Callable[[], None] = lambda: None) -> domain.RunReport:
        """Dispatch one claimed task to its worker and record the outcome (never raises).

        ``answered`` is called as soon as the worker has answered: writing the outcome is batched
        with others' and needs no dispatch slot (the lease keeps the task from being claimed)."""
        report = domain.RunReport(claimed.id, claimed.state.name, claimed.attempt, domain.Outcome.SUCCEEDED)
        try:
            report = await self._run(claimed, report, answered)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("run failed unexpectedly", task_id=str(claimed.id), worker=report.name)
            report.ended(
                domain.Outcome.UNCERTAIN, "the scheduler failed while running the task; its lease will expire"
            )
        finally:
            self.metrics.executed.labels(report.name, report.outcome.value).inc()
        return report

    async def _run(
        self, claimed: Claimed, report: domain.RunReport, answered: Callable[[], None]
    ) -> domain.RunReport:
        state = claimed.state
        started = time.perf_counter()
        lag = (claimed.db_now - claimed.due).total_seconds()
        if claimed.concurrent and claimed.slot is not None and not await self._advance(claimed):
            # Given up rather than run: whoever takes the lease over sets the slot, then runs it.
            error = "the next slot could not be set; the run was not dispatched"
            with contextlib.suppress(ParleyError):
                await self.store.release_lease(claimed.id, claimed.token, error)
            return report.ended(domain.Outcome.UNCERTAIN, error)
        if rules.is_overdue(state, claimed.db_now):
            self.metrics.overdue.labels(state.name).inc()
            log.warning(
                "repeat task overdue",
                task_id=str(claimed.id),
                worker=state.name,
                late_seconds=round(lag, 3),
                missed_run=state.schedule.missed_run.value,
            )
            if state.schedule.missed_run is domain.MissedRun.SKIP:
                skip = functools.partial(rules.on_skip, now=claimed.db_now)
                return await self._finish(claimed, skip, report, started)
        self.metrics.lag.observe(max(0.0, lag))
        decide, report = await self._dispatch(claimed, report)
        answered()
        if decide is None:
            report.duration_ms = (time.perf_counter() - started) * 1000
            return report
        return await self._finish(claimed, decide, report, started)

    async def _advance(self, claimed: Claimed) -> bool:
        """A non-blocking task's slot was claimed: set its next slot, so that the task is claimed again
        when that comes due, whether or not this run is over. False: the database did not answer; the
        run is not dispatched and its lease is given up (whoever takes it over sets the slot)."""
        slot = claimed.slot
        assert slot is not None
        following, ready = rules.slot_after_claim(claimed.state, claimed.db_now)
        try:
            # Not applied: the slot was set already (this run was taken over), or an operator moved it.
            await retrying(
                lambda: self.store.advance_slot(claimed.id, slot, following, ready),
                attempts=ADVANCE_ATTEMPTS,
                backoff=ADVANCE_BACKOFF,
            )
        except ParleyError as exc:
            log.warning("next slot not set", task_id=str(claimed.id), error=str(exc))
            return False
        return True

    async def _dispatch(
        self, claimed: Claimed, report: domain.RunReport
    ) -> tuple[Decision | None, domain.RunReport]:
        """The run's outcome, or None when it is unknown (the lease was given up or lost)."""
        state = claimed.state
        cfg = self.config
        timeout_ms = state.schedule.timeout_ms or cfg.timeout_ms
        deadline = claimed.db_now + timedelta(milliseconds=timeout_ms)
        request, reply_to = self.batches.add(run_subject(self.bus.subjects, state.name))
        request.heartbeat_subject = self.heartbeat_subject
        request.lease_ms = float(cfg.lease_ms)
        task_to_proto(claimed.task, out=request.task)
        lease_to_proto(claimed.lease, claimed.attempt, deadline, out=request.lease)
        key = claimed.token
        now = asyncio.get_running_loop().time()
        entry = Inflight(
            str(claimed.id),
            claimed.token,
            deadline=now + cfg.lease_ms / 1000,
            gives_up_at=now + timeout_ms / 1000 + REPLY_MARGIN_SECONDS,
            reply=reply_to,
        )
        self.inflight[key] = entry
        sent = time.perf_counter()
        try:
            self._watch()
            reply = await reply_to
        except ParleyError as exc:
            if not codes.NO_RESPONDERS.matches(exc):
                return None, await self._uncertain(claimed, entry, exc, report)
            in_grace = time.monotonic() - self.started < cfg.no_worker_grace
            decide: Decision = functools.partial(
                rules.on_no_worker, in_grace=in_grace, retry_ms=cfg.no_worker_retry_ms
            )
            if not in_grace:
                log.warning("no worker serves task", task_id=str(claimed.id), worker=state.name)
            report.error = decide(state).last_error or ""
            return decide, report
        except WorkerSilent as exc:
            return None, await self._uncertain(claimed, entry, exc, report)
        finally:
            self.inflight.pop(key, None)
            self.metrics.duration.labels(state.name).observe(time.perf_counter() - sent)
        decide, error = self._outcome(claimed, reply)
        report.error = error
        return decide, report

    def _watch(self) -> None:
        """Look at the runs in flight every ``WATCH_SECONDS`` while there are any: one timer for
        them all, not one per run (see ``parley_platform.bus.Inbox``)."""
        if self._watching is None:
            self._watching = asyncio.get_running_loop().call_later(WATCH_SECONDS, self._check_inflight)

    def _check_inflight(self) -> None:
        now = asyncio.get_running_loop().time()
        for entry in self.inflight.values():
            if entry.deadline <= now:
                entry.fail("no reply or heartbeat within the lease")
            elif entry.gives_up_at <= now:
                entry.fail("no reply within the run's timeout")
        self._watching = None
        if self.inflight:
            self._watch()

    def _outcome(self, claimed: Claimed, result: Reply) -> tuple[Decision, str]:
        """What the worker's reply decides, and the error it reported ("" for a success)."""
        if isinstance(result, common_pb2.Error):
            error = f"{result.code}: {result.message}"
            return self._failed(claimed.db_now, error, None), error
        now = claimed.now()
        if result.failed:
            # An unset retry_at reads as the epoch, which datetime_of makes None.
            return self._failed(now, result.error, datetime_of(result.retry_at)), result.error
        next_interval = result.next_interval_ms if result.HasField("next_interval_ms") else None
        decide = functools.partial(
            rules.on_success, now=now, next_interval_ms=next_interval, preserve=result.preserve
        )
        return decide, ""

    @staticmethod
    def _failed(now: datetime, error: str, retry_at: datetime | None) -> Decision:
        return functools.partial(rules.on_failure, now=now, error=error, retry_at=retry_at)

    async def _uncertain(
        self, claimed: Claimed, entry: Inflight, exc: BaseException, report: domain.RunReport
    ) -> domain.RunReport:
        """The worker never answered: give the lease up so the slot runs again as the next attempt."""
        if entry.lost:
            self.metrics.conflicts.inc()
            return report.ended(domain.Outcome.LOST, "the lease was lost while the task ran")
        cause = (
            "the worker went silent"
            if isinstance(exc, WorkerSilent)
            else f"dispatch failed ({exc.code if isinstance(exc, ParleyError) else type(exc).__name__})"
        )
        reason = f"attempt {claimed.attempt} uncertain: {cause}"
        try:
            await self.store.release_lease(claimed.id, claimed.token, reason)
        except ParleyError as db_exc:
            log.warning("lease not released, it will expire", task_id=str(claimed.id), error=str(db_exc))
        log.warning("run uncertain", task_id=str(claimed.id), worker=claimed.state.name, reason=reason)
        self.wake()
        return report.ended(domain.Outcome.UNCERTAIN, reason)

    async def _finish(
        self, claimed: Claimed, decide: Decision, report: domain.RunReport, started: float
    ) -> domain.RunReport:
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
            log.warning("completion rejected, lease lost", task_id=str(report.task_id), worker=report.name)
            return report.ended(
                domain.Outcome.LOST,
                "the lease was lost before the run completed; its outcome was not recorded",
            )
        if completion.status is domain.Status.PAUSED and completion.pause_reason is not None:
            self.metrics.paused.labels(completion.pause_reason.value).inc()
            log.warning(
                "task paused",
                task_id=str(report.task_id),
                worker=report.name,
                reason=completion.pause_reason.value,
                failures=completion.failure_count,
            )
        report.outcome = completion.outcome
        return report

    async def _finish_run(self, claimed: Claimed, decide: Decision) -> tuple[bool, domain.Completion]:
        """Complete one run of a non-blocking task: a compare-and-set on the task as the outcome was
        computed from, computed again from the task as it is when another completion came first."""
        state = claimed.state
        for attempt in range(1, FINISH_RUN_TRIES + 1):
            completion = rules.for_concurrent_run(decide(state))
            try:
                applied, held = await self.store.finish_run(run_completion_row(claimed, state, completion))
            except ParleyError as exc:
                if not exc.retryable or attempt == FINISH_RUN_TRIES:
                    raise
                await asyncio.sleep(FINISH_RUN_BACKOFF.delay(attempt))
                continue
            if applied or not held:
                return applied, completion
            current = await self.store.get(claimed.id, None)
            if current is None:
                return False, completion
            state = replace(current.state, next_run_at=state.next_run_at)
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
        entry.deadline = asyncio.get_running_loop().time() + self.config.lease_ms / 1000
        task = asyncio.create_task(self._extend(msg, beat, entry))
        self.extending.add(task)
        task.add_done_callback(self.extending.discard)

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
            entry.fail("lease lost")
            self.metrics.conflicts.inc()
            await self._answer(msg, scheduler_pb2.TaskHeartbeatResponse(held=False))
            return
        await self._answer(msg, scheduler_pb2.TaskHeartbeatResponse(held=True, expires_at=timestamp(expires)))

    async def _answer(self, msg: Msg, answer: scheduler_pb2.TaskHeartbeatResponse) -> None:
        if msg.reply:
            with contextlib.suppress(nats.errors.Error):
                await self.bus.nc.publish(msg.reply, answer.SerializeToString())
