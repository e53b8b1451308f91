"""The scheduler's rules, without I/O: when a task runs next, and what each run's outcome does to it.

The store writes what these functions decide, each decision in one statement fenced by the lease
token, so the rules live here once and are unit-tested.
"""

from __future__ import annotations

import math
from dataclasses import replace
from datetime import datetime, timedelta

from . import errors
from .domain import (
    DEFAULT_BACKOFF_BASE_MS,
    MAX_INTERVAL_MS,
    Completion,
    Outcome,
    PauseReason,
    Schedule,
    Status,
    Task,
    TaskState,
)

MAX_BACKOFF_MS = 300_000
# A one-shot kept by `preserve` waits this long before a queue poll runs it again.
PRESERVE_DELAY_MS = DEFAULT_BACKOFF_BASE_MS
MAX_ERROR_CHARS = 2000
ADAPTIVE_INVALID = errors.TASK_ADAPTIVE_INTERVAL_INVALID.code


# --- schedules ----------------------------------------------------------------------------------


def first_run(*, repeat: bool, schedule: Schedule, due_at: datetime | None, created_at: datetime) -> datetime:
    """The first ideal run time of a new task.

    A one-shot is due at ``due_at``, else ``scheduled_at``, else at once. A
    repeat task starts at ``due_at`` when given; otherwise its creation counts
    as the last run, so the first run comes one interval (or cron slot) later.
    """
    explicit = due_at or (schedule.scheduled_at if not repeat else None)
    if explicit is not None:
        return explicit
    if not repeat:
        return created_at
    parsed = schedule.parsed_cron()
    if parsed is not None:
        return parsed.next_after(created_at)
    assert schedule.update_interval_ms is not None
    return created_at + timedelta(milliseconds=schedule.update_interval_ms)


def rescheduled(
    task: Task, schedule: Schedule, *, repeat: bool, due_at: datetime | None, due_changed: bool, now: datetime
) -> datetime:
    """The next ideal run of a task whose schedule an operator changed.

    A due_at set by the change wins. Otherwise a one-shot is due at its due_at or scheduled_at, else
    now; a cron task at its next slot after now; an interval task one interval after its last run
    (or its creation).
    """
    if due_changed and due_at is not None:
        return due_at
    if not repeat:
        return due_at or schedule.scheduled_at or now
    parsed = schedule.parsed_cron()
    if parsed is not None:
        return parsed.next_after(now)
    return first_run(
        repeat=True, schedule=schedule, due_at=None, created_at=task.last_run_at or task.created_at
    )


def ready_at(next_run_at: datetime, schedule: Schedule, *, repeat: bool) -> datetime:
    """When the run becomes due: ``not_before`` early for a repeat task."""
    if not repeat or not schedule.not_before_ms:
        return next_run_at
    return next_run_at - timedelta(milliseconds=schedule.not_before_ms)


def slot_length_ms(schedule: Schedule, ideal: datetime) -> int:
    parsed = schedule.parsed_cron()
    if parsed is not None:
        following = parsed.next_after(ideal)
        return int((following - ideal) / timedelta(milliseconds=1))
    return schedule.update_interval_ms or DEFAULT_BACKOFF_BASE_MS


def is_overdue(state: TaskState, now: datetime) -> bool:
    """Later than ``ideal + not_after`` (default: a whole slot late): a run was missed."""
    if not state.repeat:
        return False
    grace = state.schedule.not_after_ms
    if grace is None:
        grace = slot_length_ms(state.schedule, state.next_run_at)
    return now > state.next_run_at + timedelta(milliseconds=grace)


def next_slot_after(schedule: Schedule, ideal: datetime, now: datetime) -> datetime:
    """The first slot of the task's cadence later than ``now``."""
    parsed = schedule.parsed_cron()
    if parsed is not None:
        return parsed.next_after(now)
    step = timedelta(milliseconds=schedule.update_interval_ms or DEFAULT_BACKOFF_BASE_MS)
    missed = math.floor((now - ideal) / step) + 1
    return ideal + step * max(1, missed)


def concurrent(state: TaskState) -> bool:
    """Whether the task's runs may overlap: a repeat task with ``blocking: false``."""
    return state.repeat and not state.schedule.blocking


def slot_after_claim(state: TaskState, now: datetime) -> tuple[datetime, datetime]:
    """(next_run_at, ready_at) of a non-blocking task whose slot ``state.next_run_at`` was just claimed:
    the first slot of its cadence after both the claimed one and now. The schedule moves on at the
    claim, not at the run's end; after downtime the late slot runs once and the cadence goes on."""
    s = state.schedule
    following = next_slot_after(s, state.next_run_at, max(now, state.next_run_at))
    return following, ready_at(following, s, repeat=True)


def for_concurrent_run(completion: Completion) -> Completion:
    """A non-blocking task's run outcome. Its next slot was set when the run was claimed, so a success
    or a skip leaves it where it is; a failure's backoff (or retry_at, or a no-worker retry) may only
    push it later. Failure counting, backoff intervals and pauses apply as to any run."""
    if completion.outcome in (Outcome.SUCCEEDED, Outcome.SKIPPED) or (
        completion.keep_schedule and not completion.delay_ms
    ):
        return replace(completion, next_at=None, delay_ms=0, keep_schedule=True)
    return completion


def clip_error(text: str) -> str:
    return text if len(text) <= MAX_ERROR_CHARS else text[: MAX_ERROR_CHARS - 1] + "…"


def _after_success_schedule(state: TaskState, now: datetime) -> tuple[datetime | None, int]:
    """(next_at, delay_ms) of the next run after a run that ended now."""
    parsed = state.schedule.parsed_cron()
    if parsed is not None:
        return parsed.next_after(now), 0
    assert state.schedule.update_interval_ms is not None
    return None, state.schedule.update_interval_ms


def on_success(
    state: TaskState, now: datetime, *, next_interval_ms: float | None, preserve: bool
) -> Completion:
    s = state.schedule
    if preserve:
        # The task stays as it was (a one-shot is not deleted); only the run itself is recorded.
        next_at, delay = _after_success_schedule(state, now) if state.repeat else (None, PRESERVE_DELAY_MS)
        return Completion(
            Outcome.SUCCEEDED,
            failure_count=state.failure_count,
            last_error=state.last_error,
            update_interval_ms=s.update_interval_ms,
            base_interval_ms=s.base_interval_ms,
            next_at=next_at,
            delay_ms=delay,
            not_before_ms=s.not_before_ms if state.repeat else 0,
            ran=True,
        )
    if not state.repeat:
        return Completion(Outcome.SUCCEEDED, delete=True, ran=True)
    interval = s.update_interval_ms
    base = s.base_interval_ms
    error: str | None = None
    if s.cron:
        # Backoff borrowed an interval; on success the cron expression alone schedules again.
        if next_interval_ms is not None:
            error = f"{ADAPTIVE_INVALID}: a cron task ignores next_interval_ms"
        interval, base = None, None
    elif next_interval_ms is not None and valid_interval(next_interval_ms):
        interval, base = max(1, round(next_interval_ms)), None
    else:
        if next_interval_ms is not None:
            error = (
                f"{ADAPTIVE_INVALID}: next_interval_ms {next_interval_ms!r} is not in (0, {MAX_INTERVAL_MS}]"
            )
        if base is not None and interval is not None:
            interval = base
    next_at, delay = _after_success_schedule(
        replace(state, schedule=replace(s, update_interval_ms=interval)), now
    )
    return Completion(
        Outcome.SUCCEEDED,
        last_error=error,
        update_interval_ms=interval,
        base_interval_ms=base,
        next_at=next_at,
        delay_ms=delay,
        not_before_ms=s.not_before_ms,
        ran=True,
    )


def valid_interval(value: float) -> bool:
    return math.isfinite(value) and 0 < value <= MAX_INTERVAL_MS


def backoff_ms(schedule: Schedule, failure_count: int) -> tuple[int, int]:
    """(base, interval) after ``failure_count`` consecutive failures: min(base × 2^n, 300 s)."""
    base = schedule.base_interval_ms or schedule.update_interval_ms or DEFAULT_BACKOFF_BASE_MS
    return base, min(base * 2 ** min(failure_count, 40), MAX_BACKOFF_MS)


def on_failure(state: TaskState, now: datetime, *, error: str, retry_at: datetime | None) -> Completion:
    s = state.schedule
    count = state.failure_count + 1
    base, interval = backoff_ms(s, count)
    message = clip_error(error or "the worker reported a failure without a message")
    if not state.repeat:
        if count >= s.max_attempts:
            return Completion(
                Outcome.FAILED,
                status=Status.FAILED,
                failure_count=count,
                last_error=message,
                update_interval_ms=s.update_interval_ms,
                base_interval_ms=s.base_interval_ms,
                keep_schedule=True,
                ran=True,
            )
        return Completion(
            Outcome.FAILED,
            failure_count=count,
            last_error=message,
            update_interval_ms=s.update_interval_ms,
            base_interval_ms=s.base_interval_ms,
            next_at=retry_at,
            delay_ms=interval,
            ran=True,
        )
    paused = s.max_failures > 0 and count >= s.max_failures
    return Completion(
        Outcome.FAILED,
        status=Status.PAUSED if paused else Status.ACTIVE,
        pause_reason=PauseReason.MAX_FAILURES if paused else None,
        failure_count=count,
        last_error=message,
        update_interval_ms=interval,
        base_interval_ms=base,
        next_at=retry_at,
        delay_ms=interval,
        not_before_ms=0,
        ran=True,
    )


def on_no_worker(state: TaskState, *, in_grace: bool, retry_ms: int) -> Completion:
    """Nobody serves the worker name. Early on (workers may still be starting) the run is skipped
    and tried again shortly; later a repeat task is paused as orphaned and a one-shot fails."""
    s = state.schedule
    message = f"no worker serves {state.name!r}"
    if in_grace:
        return Completion(
            Outcome.NO_WORKER,
            failure_count=state.failure_count,
            last_error=message,
            update_interval_ms=s.update_interval_ms,
            base_interval_ms=s.base_interval_ms,
            delay_ms=retry_ms,
            keep_schedule=True,
        )
    if state.repeat:
        return Completion(
            Outcome.NO_WORKER,
            status=Status.PAUSED,
            pause_reason=PauseReason.NO_WORKER,
            failure_count=state.failure_count,
            last_error=message,
            update_interval_ms=s.update_interval_ms,
            base_interval_ms=s.base_interval_ms,
            orphaned=True,
            keep_schedule=True,
        )
    return Completion(
        Outcome.NO_WORKER,
        status=Status.FAILED,
        failure_count=state.failure_count + 1,
        last_error=message,
        update_interval_ms=s.update_interval_ms,
        base_interval_ms=s.base_interval_ms,
        keep_schedule=True,
    )


def on_skip(state: TaskState, now: datetime) -> Completion:
    """A ``missed_run: skip`` task found overdue: move to its next slot without running."""
    s = state.schedule
    return Completion(
        Outcome.SKIPPED,
        failure_count=state.failure_count,
        update_interval_ms=s.update_interval_ms,
        base_interval_ms=s.base_interval_ms,
        next_at=next_slot_after(s, state.next_run_at, now),
        not_before_ms=s.not_before_ms,
    )
