"""The task system's objects, without I/O: tasks as created, stored and claimed, leases, run outcomes,
and what makes a task valid. The rules that move tasks along are in ``rules``."""

from __future__ import annotations

import json
import math
import re
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any

from parley_platform import codes
from parley_platform.convert import uuid_or_none
from parley_platform.errors import ParleyError

from . import cron as cronlib
from . import errors

QUEUE_TAG = "queue"
REPEAT_TAG = "repeat"
DEFAULT_MAX_FAILURES = 5
DEFAULT_BACKOFF_BASE_MS = 1000
MAX_INTERVAL_MS = 366 * 24 * 3600 * 1000
MAX_TIMEOUT_MS = 24 * 3600 * 1000
MAX_DESCRIPTION = 2000
MAX_TAGS = 32
MAX_VALUES_BYTES = 64 * 1024
NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_\-]{0,99}$")
TAG_PATTERN = re.compile(r"^[^\s,]{1,64}$")
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


def schedule_invalid(field_name: str, problem: str) -> ParleyError:
    return errors.TASK_SCHEDULE_INVALID(f"{field_name} {problem}")


def invalid(field_name: str, problem: str) -> ParleyError:
    return errors.TASK_INVALID(f"{field_name} {problem}")


@dataclass(slots=True)
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
class Lease:
    """A claim on a run: only its holder, naming the token, may extend or complete it."""

    owner: str
    token: int
    expires_at: datetime


@dataclass(slots=True)
class Task:
    """A stored task, as the database had it at ``read_at`` (its clock; None: not read with it)."""

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
    status: Status
    pause_reason: PauseReason | None
    failure_count: int
    last_error: str | None
    last_run_at: datetime | None
    run_count: int
    next_run_at: datetime  # the ideal time of the next run
    ready_at: datetime | None  # when it is due (None: a claimed non-blocking slot awaits its next one)
    orphaned_no_worker: bool
    attempt: int
    lease: Lease | None  # the lease of the task's run (a blocking task's), expired or not
    revision: int
    created_at: datetime
    updated_at: datetime
    read_at: datetime | None = None
    live_runs: int = 0  # a non-blocking task's runs in flight, each with a lease of its own

    @property
    def repeat(self) -> bool:
        return REPEAT_TAG in self.tags

    @property
    def queued(self) -> bool:
        """Whether the claim loops poll the task (else only ExecuteTask or RunDueTasks run it)."""
        return QUEUE_TAG in self.tags

    @property
    def live_lease(self) -> Lease | None:
        """The lease, unless it had expired when the task was read."""
        if self.lease is None or (self.read_at is not None and self.lease.expires_at <= self.read_at):
            return None
        return self.lease

    @property
    def executing(self) -> bool:
        """A live lease holds the task, or one of its runs (a non-blocking task's)."""
        return self.live_lease is not None or self.live_runs > 0

    @property
    def state(self) -> TaskState:
        return TaskState(
            id=self.id,
            name=self.name,
            repeat=self.repeat,
            schedule=self.schedule,
            failure_count=self.failure_count,
            last_error=self.last_error,
            next_run_at=self.next_run_at,
            last_run_at=self.last_run_at,
            created_at=self.created_at,
            revision=self.revision,
        )


@dataclass(frozen=True)
class TaskEdit:
    """An operator's change of a task, validated as a whole, to apply only at ``revision``."""

    id: uuid.UUID
    revision: int
    description: str
    tags: tuple[str, ...]
    room_id: uuid.UUID | None
    world_id: uuid.UUID | None
    entity_id: uuid.UUID | None
    due_at: datetime | None
    schedule: Schedule
    values: dict[str, Any]
    next_run_at: datetime
    ready_at: datetime


@dataclass(frozen=True)
class UncertainAttempt:
    """An attempt whose lease expired before it completed: it may or may not have run."""

    attempt: int
    owner: str
    claimed_at: datetime | None
    expired_at: datetime
    reclaimed_at: datetime


@dataclass(slots=True)
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


@dataclass(slots=True)
class RunReport:
    """What happened to one run, filled in as it goes by the dispatch that holds it (a record per
    run, not a value: ``dataclasses.replace`` of a frozen one, three times a run, was 6 % of the
    scheduler's CPU under load)."""

    task_id: uuid.UUID
    name: str
    attempt: int
    outcome: Outcome
    error: str = ""
    duration_ms: float = 0.0
    deleted: bool = False

    def ended(self, outcome: Outcome, error: str) -> RunReport:
        self.outcome, self.error = outcome, error
        return self


# --- validation ---------------------------------------------------------------------------------


def optional_uuid(value: str, field_name: str) -> uuid.UUID | None:
    """An id field that may be left empty."""
    if not value:
        return None
    parsed = uuid_or_none(value)
    if parsed is None:
        # The value is not echoed: a caller may have put a secret in the wrong field.
        raise codes.INVALID_ID(f"{field_name} must be a UUID")
    return parsed


def required_uuid(value: str, field_name: str) -> uuid.UUID:
    parsed = optional_uuid(value, field_name)
    if parsed is None:
        raise invalid(field_name, "is required")
    return parsed


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

    @classmethod
    def of(cls, schedule: Schedule) -> MetadataInput:
        """A stored schedule as input again: what an update's masked fields replace."""
        return cls(
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
    task_id = optional_uuid(id, "id") or uuid.uuid4()
    agent = required_uuid(agent_id, "agent_id")
    return NewTask(
        id=task_id,
        agent_id=agent,
        name=validate_name(name),
        description=validate_description(description),
        tags=checked_tags,
        room_id=optional_uuid(room_id, "room_id"),
        world_id=optional_uuid(world_id, "world_id"),
        entity_id=optional_uuid(entity_id, "entity_id"),
        due_at=_moment(due_at, "due_at"),
        schedule=validate_schedule(metadata, repeat=REPEAT_TAG in checked_tags),
        values=validate_values(values),
    )
