"""The task system's rules, without I/O: validation, schedules, and what each run outcome does.

The store writes what these functions decide, each decision in one statement
fenced by the lease token, so the rules live here once and are unit-tested.
"""

from __future__ import annotations

import json
import math
import re
import uuid
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from enum import StrEnum
from typing import Any

from parley_platform.errors import InvalidArgument

from . import cron as cronlib

QUEUE_TAG = "queue"
REPEAT_TAG = "repeat"
DEFAULT_MAX_FAILURES = 5
DEFAULT_BACKOFF_BASE_MS = 1000
MAX_BACKOFF_MS = 300_000
# A one-shot kept by `preserve` waits this long before a queue poll runs it again.
PRESERVE_DELAY_MS = DEFAULT_BACKOFF_BASE_MS
MAX_INTERVAL_MS = 366 * 24 * 3600 * 1000
MAX_TIMEOUT_MS = 24 * 3600 * 1000
MAX_DESCRIPTION = 2000
MAX_TAGS = 32
MAX_VALUES_BYTES = 64 * 1024
MAX_ERROR_CHARS = 2000
NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_\-]{0,99}$")
TAG_PATTERN = re.compile(r"^[^\s,]{1,64}$")
SCHEDULE_INVALID = "TASK_SCHEDULE_INVALID"
ADAPTIVE_INVALID = "TASK_ADAPTIVE_INTERVAL_INVALID"
EARLIEST = datetime(1970, 1, 1, tzinfo=UTC)
LATEST = datetime(9999, 1, 1, tzinfo=UTC)


class Status(StrEnum):
    ACTIVE = "active"
    PAUSED = "paused"
    RUNNING = "running"
    FAILED = "failed"


class PauseReason(StrEnum):
    OPERATOR = "operator"
    MAX_FAILURES = "max_failures"
    NO_WORKER = "no_worker"


class MissedRun(StrEnum):
    RUN_ONCE = "run_once"
    SKIP = "skip"


class Outcome(StrEnum):
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    NO_WORKER = "no_worker"
    UNCERTAIN = "uncertain"
    SKIPPED = "skipped"
    LOST = "lost"


def schedule_invalid(field_name: str, problem: str) -> InvalidArgument:
    return InvalidArgument(
        f"{field_name} {problem}",
        code=SCHEDULE_INVALID,
        hint="intervals are positive finite milliseconds; cron is 5 fields in UTC",
    )


def invalid(field_name: str, problem: str, code: str = "TASK_INVALID") -> InvalidArgument:
    return InvalidArgument(f"{field_name} {problem}", code=code)


@dataclass(frozen=True)
class Schedule:
    """When and how a task runs: the typed form of its metadata."""

    update_interval_ms: int | None = None
    base_interval_ms: int | None = None
    not_before_ms: int = 0
    not_after_ms: int | None = None
    max_failures: int = DEFAULT_MAX_FAILURES  # <= 0: never paused
    max_attempts: int = 1
    blocking: bool = True
    missed_run: MissedRun = MissedRun.RUN_ONCE
    cron: str | None = None
    scheduled_at: datetime | None = None
    timeout_ms: int | None = None

    def parsed_cron(self) -> cronlib.Cron | None:
        return cronlib.parse(self.cron) if self.cron else None


@dataclass(frozen=True)
class NewTask:
    """A validated task, ready to insert."""

    id: uuid.UUID
    agent_id: uuid.UUID
    name: str
    description: str
    tags: tuple[str, ...]
    room_id: uuid.UUID | None
    world_id: uuid.UUID | None
    entity_id: uuid.UUID | None
    due_at: datetime | None
    schedule: Schedule
    values: dict[str, Any]

    @property
    def repeat(self) -> bool:
        return REPEAT_TAG in self.tags


@dataclass(frozen=True)
class TaskState:
    """What the rules need of a stored task (a claimed row, or one being updated)."""

    id: uuid.UUID
    name: str
    repeat: bool
    schedule: Schedule
    failure_count: int
    last_error: str | None
    next_run_at: datetime
    last_run_at: datetime | None
    created_at: datetime
    revision: int


@dataclass(frozen=True)
class Completion:
    """What one run's outcome does to its task, written in one statement fenced by the lease token.

    ``delete`` removes the task. Otherwise ``next_at`` (absolute) and
    ``delay_ms`` (from the database's now) give the next run, the later of the
    two; a field left ``None`` keeps the stored value where noted.
    """

    outcome: Outcome
    delete: bool = False
    status: Status = Status.ACTIVE
    pause_reason: PauseReason | None = None
    failure_count: int = 0
    last_error: str | None = None
    update_interval_ms: int | None = None
    base_interval_ms: int | None = None
    next_at: datetime | None = None
    delay_ms: int = 0
    not_before_ms: int = 0
    ran: bool = False  # sets last_run_at and counts the run
    orphaned: bool = False
    # Leave the next run as stored; ``delay_ms`` then only postpones when it is due.
    keep_schedule: bool = False


# --- validation ---------------------------------------------------------------------------------


def parse_uuid(value: str, field_name: str, *, required: bool = False) -> uuid.UUID | None:
    if not value:
        if required:
            raise invalid(field_name, "is required", code="TASK_INVALID")
        return None
    try:
        return uuid.UUID(value)
    except ValueError:
        raise invalid(field_name, "must be a UUID", code="INVALID_ID") from None


def _duration(value: float | None, field_name: str, *, positive: bool, maximum: int) -> int | None:
    if value is None:
        return None
    if not math.isfinite(value):
        raise schedule_invalid(field_name, "must be finite")
    if positive and value <= 0:
        raise schedule_invalid(field_name, "must be greater than 0")
    if value < 0:
        raise schedule_invalid(field_name, "must not be negative")
    if value > maximum:
        raise schedule_invalid(field_name, f"must be at most {maximum} ms")
    return max(1, round(value)) if positive else round(value)


def _moment(value: datetime | None, field_name: str) -> datetime | None:
    if value is None:
        return None
    if value.tzinfo is None:
        value = value.replace(tzinfo=UTC)
    if not EARLIEST <= value < LATEST:
        raise schedule_invalid(field_name, "must be a time between 1970 and 9999")
    return value


@dataclass(frozen=True)
class MetadataInput:
    """Metadata as a caller sent it, before validation (None = not given)."""

    update_interval_ms: float | None = None
    base_interval_ms: float | None = None
    not_before_ms: float | None = None
    not_after_ms: float | None = None
    max_failures: float | None = None
    max_attempts: int | None = None
    blocking: bool | None = None
    missed_run: str | None = None
    cron: str = ""
    scheduled_at: datetime | None = None
    timeout_ms: float | None = None


def validate_schedule(meta: MetadataInput, *, repeat: bool) -> Schedule:
    interval = _duration(
        meta.update_interval_ms, "metadata.update_interval_ms", positive=True, maximum=MAX_INTERVAL_MS
    )
    base = _duration(
        meta.base_interval_ms, "metadata.base_interval_ms", positive=True, maximum=MAX_INTERVAL_MS
    )
    not_before = _duration(
        meta.not_before_ms, "metadata.not_before_ms", positive=False, maximum=MAX_INTERVAL_MS
    )
    not_after = _duration(meta.not_after_ms, "metadata.not_after_ms", positive=False, maximum=MAX_INTERVAL_MS)
    timeout = _duration(meta.timeout_ms, "metadata.timeout_ms", positive=True, maximum=MAX_TIMEOUT_MS)
    max_failures = DEFAULT_MAX_FAILURES
    if meta.max_failures is not None:
        if math.isnan(meta.max_failures):
            raise schedule_invalid("metadata.max_failures", "must be a number")
        if math.isinf(meta.max_failures) or meta.max_failures <= 0:
            max_failures = 0
        elif meta.max_failures != int(meta.max_failures) or meta.max_failures > 1_000_000:
            raise schedule_invalid("metadata.max_failures", "must be a whole number up to 1000000")
        else:
            max_failures = int(meta.max_failures)
    max_attempts = 1 if meta.max_attempts is None else meta.max_attempts
    if not 1 <= max_attempts <= 1000:
        raise schedule_invalid("metadata.max_attempts", "must be from 1 to 1000")
    missed = (meta.missed_run or MissedRun.RUN_ONCE.value).lower()
    if missed not in {m.value for m in MissedRun}:
        raise schedule_invalid("metadata.missed_run", "must be run_once or skip")
    cron = meta.cron.strip() or None
    if cron is not None:
        if not repeat:
            raise schedule_invalid("metadata.cron", "needs the repeat tag")
        if interval is not None:
            raise schedule_invalid("metadata.cron", "and metadata.update_interval_ms exclude each other")
        try:
            cronlib.parse(cron)
        except cronlib.CronError as exc:
            raise schedule_invalid("metadata.cron", f"is invalid: {exc}") from None
    elif repeat and interval is None:
        raise schedule_invalid("metadata.update_interval_ms", "is required for a repeat task (or set cron)")
    # A blocking task's one run is leased on its row; a non-blocking repeat task's runs each have
    # a lease of their own, so a slot is claimed when it comes due even while earlier runs go on.
    blocking = True if meta.blocking is None else meta.blocking
    return Schedule(
        update_interval_ms=interval,
        base_interval_ms=base,
        not_before_ms=not_before or 0,
        not_after_ms=not_after,
        max_failures=max_failures,
        max_attempts=max_attempts,
        blocking=blocking,
        missed_run=MissedRun(missed),
        cron=cron,
        scheduled_at=_moment(meta.scheduled_at, "metadata.scheduled_at"),
        timeout_ms=timeout,
    )


def validate_name(name: str) -> str:
    if not NAME_PATTERN.match(name):
        raise invalid(
            "name",
            "must be the worker name: 1-100 letters, digits, '_' or '-', starting with a letter or digit",
        )
    return name


def validate_tags(tags: list[str]) -> tuple[str, ...]:
    if len(tags) > MAX_TAGS:
        raise invalid("tags", f"has more than {MAX_TAGS} entries")
    for tag in tags:
        if not TAG_PATTERN.match(tag):
            raise invalid("tags", "entries must be 1-64 characters without spaces or commas")
    return tuple(dict.fromkeys(tags))


def validate_values(values: dict[str, Any]) -> dict[str, Any]:
    if len(json.dumps(values, separators=(",", ":"))) > MAX_VALUES_BYTES:
        raise invalid("metadata.values", f"is larger than {MAX_VALUES_BYTES} bytes")
    return values


def validate_description(description: str) -> str:
    if len(description) > MAX_DESCRIPTION:
        raise invalid("description", f"is longer than {MAX_DESCRIPTION} characters")
    return description


def new_task(
    *,
    id: str,
    agent_id: str,
    name: str,
    description: str,
    tags: list[str],
    room_id: str,
    world_id: str,
    entity_id: str,
    due_at: datetime | None,
    metadata: MetadataInput,
    values: dict[str, Any],
) -> NewTask:
    checked_tags = validate_tags(tags)
    task_id = parse_uuid(id, "id") or uuid.uuid4()
    agent = parse_uuid(agent_id, "agent_id", required=True)
    assert agent is not None
    return NewTask(
        id=task_id,
        agent_id=agent,
        name=validate_name(name),
        description=validate_description(description),
        tags=checked_tags,
        room_id=parse_uuid(room_id, "room_id"),
        world_id=parse_uuid(world_id, "world_id"),
        entity_id=parse_uuid(entity_id, "entity_id"),
        due_at=_moment(due_at, "due_at"),
        schedule=validate_schedule(metadata, repeat=REPEAT_TAG in checked_tags),
        values=validate_values(values),
    )


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
