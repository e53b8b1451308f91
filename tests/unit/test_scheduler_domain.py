"""The scheduler's rules without I/O: validation, cron, first runs, and what each outcome does."""

from __future__ import annotations

import dataclasses
import math
import uuid
from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from parley_platform.errors import InvalidArgument
from parley_scheduler import cron, domain, rules
from parley_scheduler.domain import MetadataInput, Outcome, PauseReason, Schedule, Status, TaskState

NOW = datetime(2025, 3, 10, 12, 0, 0, tzinfo=UTC)


def state(*, repeat: bool = True, failures: int = 0, **schedule: object) -> TaskState:
    return TaskState(
        id=uuid.uuid4(),
        name="WORK",
        repeat=repeat,
        schedule=Schedule(**schedule),  # type: ignore[arg-type]
        failure_count=failures,
        last_error=None,
        next_run_at=NOW,
        last_run_at=None,
        created_at=NOW - timedelta(hours=1),
        revision=1,
    )


# --- validation -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("meta", "field"),
    [
        (MetadataInput(update_interval_ms=math.nan), "metadata.update_interval_ms"),
        (MetadataInput(update_interval_ms=math.inf), "metadata.update_interval_ms"),
        (MetadataInput(update_interval_ms=0), "metadata.update_interval_ms"),
        (MetadataInput(update_interval_ms=-5), "metadata.update_interval_ms"),
        (MetadataInput(update_interval_ms=1000, base_interval_ms=0), "metadata.base_interval_ms"),
        (MetadataInput(update_interval_ms=1000, not_before_ms=-1), "metadata.not_before_ms"),
        (MetadataInput(update_interval_ms=1000, not_after_ms=-1), "metadata.not_after_ms"),
        (MetadataInput(update_interval_ms=1000, not_after_ms=math.inf), "metadata.not_after_ms"),
        (MetadataInput(cron="61 * * * *"), "metadata.cron"),
        (MetadataInput(cron="* * *"), "metadata.cron"),
        (MetadataInput(cron="0 0 30 2 *"), "metadata.cron"),
        (MetadataInput(cron="*/0 * * * *"), "metadata.cron"),
        (MetadataInput(cron="5-1 * * * *"), "metadata.cron"),
        (MetadataInput(cron="* * * * *", update_interval_ms=1000), "metadata.cron"),
        (MetadataInput(), "metadata.update_interval_ms"),
        (MetadataInput(update_interval_ms=1000, max_failures=math.nan), "metadata.max_failures"),
        (MetadataInput(update_interval_ms=1000, max_failures=2.5), "metadata.max_failures"),
        (MetadataInput(update_interval_ms=1000, max_attempts=0), "metadata.max_attempts"),
        (MetadataInput(update_interval_ms=1000, missed_run="later"), "metadata.missed_run"),
        (MetadataInput(update_interval_ms=1000, timeout_ms=0), "metadata.timeout_ms"),
        (
            MetadataInput(update_interval_ms=1000, scheduled_at=datetime(1969, 1, 1, tzinfo=UTC)),
            "metadata.scheduled_at",
        ),
    ],
)
def test_invalid_schedules_name_their_field(meta: MetadataInput, field: str) -> None:
    with pytest.raises(InvalidArgument) as caught:
        domain.validate_schedule(meta, repeat=True)
    assert caught.value.code == "TASK_SCHEDULE_INVALID"
    assert caught.value.message.startswith(field), caught.value.message


def test_cron_needs_the_repeat_tag() -> None:
    with pytest.raises(InvalidArgument) as caught:
        domain.validate_schedule(MetadataInput(cron="* * * * *"), repeat=False)
    assert caught.value.message.startswith("metadata.cron")


def test_defaults_and_never_pausing_values() -> None:
    s = domain.validate_schedule(MetadataInput(update_interval_ms=1000.4), repeat=True)
    assert (s.update_interval_ms, s.max_failures, s.max_attempts, s.blocking) == (1000, 5, 1, True)
    assert s.missed_run is domain.MissedRun.RUN_ONCE
    for never in (0, -3, math.inf, -math.inf):
        assert (
            domain.validate_schedule(
                MetadataInput(update_interval_ms=1, max_failures=never), repeat=True
            ).max_failures
            == 0
        )
    one_shot = domain.validate_schedule(MetadataInput(), repeat=False)
    assert one_shot.update_interval_ms is None


def test_blocking_false_makes_a_repeat_task_concurrent() -> None:
    for meta in (
        MetadataInput(update_interval_ms=1000, blocking=False),
        MetadataInput(cron="* * * * *", blocking=False),
    ):
        assert not domain.validate_schedule(meta, repeat=True).blocking
    assert rules.concurrent(state(update_interval_ms=1000, blocking=False))
    assert not rules.concurrent(state(update_interval_ms=1000))
    # A one-shot has one run whatever it says.
    assert not rules.concurrent(state(repeat=False, blocking=False))


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"name": "has.dot"}, "name"),
        ({"name": ""}, "name"),
        ({"name": "x" * 101}, "name"),
        ({"agent_id": ""}, "agent_id"),
        ({"agent_id": "not-a-uuid"}, "agent_id"),
        ({"room_id": "nope"}, "room_id"),
        ({"id": "nope"}, "id"),
        ({"tags": ["has space"]}, "tags"),
        ({"tags": [str(i) for i in range(33)]}, "tags"),
        ({"description": "x" * 2001}, "description"),
        ({"values": {"big": "x" * 70_000}}, "metadata.values"),
        ({"due_at": datetime(10, 1, 1, tzinfo=UTC)}, "due_at"),
    ],
)
def test_invalid_tasks_name_their_field(kwargs: dict[str, object], field: str) -> None:
    spec: dict[str, object] = {
        "id": "",
        "agent_id": str(uuid.uuid4()),
        "name": "WORK",
        "description": "",
        "tags": ["queue"],
        "room_id": "",
        "world_id": "",
        "entity_id": "",
        "due_at": None,
        "metadata": MetadataInput(),
        "values": {},
    }
    spec.update(kwargs)
    with pytest.raises(InvalidArgument) as caught:
        domain.new_task(**spec)  # type: ignore[arg-type]
    assert caught.value.message.startswith(field), caught.value.message


# --- first runs and readiness ----------------------------------------------------------------------


def test_first_runs() -> None:
    one_shot = Schedule()
    assert rules.first_run(repeat=False, schedule=one_shot, due_at=None, created_at=NOW) == NOW
    later = NOW + timedelta(minutes=5)
    assert rules.first_run(repeat=False, schedule=one_shot, due_at=later, created_at=NOW) == later
    assert (
        rules.first_run(repeat=False, schedule=Schedule(scheduled_at=later), due_at=None, created_at=NOW)
        == later
    )
    interval = Schedule(update_interval_ms=1500)
    assert rules.first_run(repeat=True, schedule=interval, due_at=None, created_at=NOW) == NOW + timedelta(
        milliseconds=1500
    )
    assert rules.first_run(repeat=True, schedule=interval, due_at=later, created_at=NOW) == later
    hourly = Schedule(cron="@hourly")
    assert rules.first_run(repeat=True, schedule=hourly, due_at=None, created_at=NOW) == NOW + timedelta(
        hours=1
    )


def test_not_before_makes_a_repeat_task_due_early() -> None:
    s = Schedule(update_interval_ms=1000, not_before_ms=200)
    assert rules.ready_at(NOW, s, repeat=True) == NOW - timedelta(milliseconds=200)
    assert rules.ready_at(NOW, s, repeat=False) == NOW


# --- success -----------------------------------------------------------------------------------------


def test_one_shot_success_deletes_it() -> None:
    done = rules.on_success(state(repeat=False), NOW, next_interval_ms=None, preserve=False)
    assert done.delete
    assert done.outcome is Outcome.SUCCEEDED


def test_repeat_success_resets_failures_and_restores_the_base_interval() -> None:
    s = state(failures=3, update_interval_ms=8000, base_interval_ms=1000)
    done = rules.on_success(s, NOW, next_interval_ms=None, preserve=False)
    assert not done.delete
    assert (done.failure_count, done.last_error, done.status) == (0, None, Status.ACTIVE)
    assert (done.update_interval_ms, done.base_interval_ms) == (1000, 1000)
    assert (done.next_at, done.delay_ms, done.ran) == (None, 1000, True)


def test_adaptive_interval_replaces_the_interval_and_drops_the_base() -> None:
    s = state(update_interval_ms=8000, base_interval_ms=1000)
    done = rules.on_success(s, NOW, next_interval_ms=250.4, preserve=False)
    assert (done.update_interval_ms, done.base_interval_ms, done.delay_ms) == (250, None, 250)
    assert done.last_error is None


@pytest.mark.parametrize("bad", [0.0, -1.0, math.nan, math.inf, 1e15])
def test_invalid_adaptive_interval_is_reported_and_ignored(bad: float) -> None:
    s = state(update_interval_ms=8000, base_interval_ms=1000)
    done = rules.on_success(s, NOW, next_interval_ms=bad, preserve=False)
    assert done.last_error is not None
    assert done.last_error.startswith("TASK_ADAPTIVE_INTERVAL_INVALID")
    assert (done.update_interval_ms, done.delay_ms, done.failure_count) == (1000, 1000, 0)


def test_preserve_keeps_the_task_as_it_was() -> None:
    one_shot = rules.on_success(state(repeat=False, failures=1), NOW, next_interval_ms=None, preserve=True)
    assert not one_shot.delete
    assert one_shot.failure_count == 1
    assert one_shot.delay_ms > 0
    repeat = rules.on_success(
        state(failures=2, update_interval_ms=4000, base_interval_ms=1000),
        NOW,
        next_interval_ms=50,
        preserve=True,
    )
    assert (repeat.update_interval_ms, repeat.base_interval_ms, repeat.failure_count) == (4000, 1000, 2)


def test_cron_success_schedules_the_next_firing_and_drops_backoff() -> None:
    s = state(cron="*/15 * * * *", update_interval_ms=4000, base_interval_ms=1000)
    done = rules.on_success(s, NOW + timedelta(minutes=1), next_interval_ms=None, preserve=False)
    assert done.next_at == NOW + timedelta(minutes=15)
    assert (done.update_interval_ms, done.base_interval_ms, done.delay_ms) == (None, None, 0)


# --- failure -----------------------------------------------------------------------------------------


def test_failures_double_the_interval_and_pause_at_the_default_limit() -> None:
    s = state(update_interval_ms=100)
    intervals = []
    for run in range(1, 6):
        done = rules.on_failure(s, NOW, error="boom", retry_at=None)
        intervals.append(done.update_interval_ms)
        assert done.failure_count == run
        assert done.last_error == "boom"
        s = dataclasses.replace(
            s,
            failure_count=done.failure_count,
            schedule=Schedule(
                update_interval_ms=done.update_interval_ms, base_interval_ms=done.base_interval_ms
            ),
        )
        if run < 5:
            assert done.status is Status.ACTIVE
    assert intervals == [200, 400, 800, 1600, 3200]
    assert done.status is Status.PAUSED
    assert done.pause_reason is PauseReason.MAX_FAILURES


def test_zero_max_failures_never_pauses_and_the_backoff_is_capped() -> None:
    done = rules.on_failure(
        state(failures=40, update_interval_ms=1000, max_failures=0), NOW, error="x", retry_at=None
    )
    assert done.status is Status.ACTIVE
    assert done.update_interval_ms == rules.MAX_BACKOFF_MS == 300_000
    assert done.base_interval_ms == 1000


def test_backoff_base_defaults_to_one_second() -> None:
    assert rules.backoff_ms(Schedule(), 1) == (1000, 2000)
    assert rules.backoff_ms(Schedule(update_interval_ms=50, base_interval_ms=70), 2) == (70, 280)


def test_retry_at_pushes_later_never_earlier() -> None:
    later = NOW + timedelta(hours=1)
    done = rules.on_failure(state(update_interval_ms=100), NOW, error="x", retry_at=later)
    assert (done.next_at, done.delay_ms) == (later, 200)  # the store takes the later of the two


def test_one_shot_failure_is_kept_failed_unless_attempts_remain() -> None:
    done = rules.on_failure(state(repeat=False), NOW, error="nope", retry_at=None)
    assert (done.status, done.delete, done.last_error, done.failure_count) == (
        Status.FAILED,
        False,
        "nope",
        1,
    )
    retried = rules.on_failure(state(repeat=False, max_attempts=3), NOW, error="nope", retry_at=None)
    assert retried.status is Status.ACTIVE
    assert retried.delay_ms == 2000
    last = rules.on_failure(state(repeat=False, max_attempts=3, failures=2), NOW, error="nope", retry_at=None)
    assert last.status is Status.FAILED


def test_failure_messages_are_clipped() -> None:
    done = rules.on_failure(state(update_interval_ms=1), NOW, error="x" * 10_000, retry_at=None)
    assert done.last_error is not None
    assert len(done.last_error) == rules.MAX_ERROR_CHARS


# --- no worker, missed runs --------------------------------------------------------------------------


def test_no_worker_skips_in_the_grace_period_then_orphans_or_fails() -> None:
    early = rules.on_no_worker(state(update_interval_ms=1000), in_grace=True, retry_ms=500)
    assert (early.status, early.keep_schedule, early.delay_ms, early.orphaned) == (
        Status.ACTIVE,
        True,
        500,
        False,
    )
    orphan = rules.on_no_worker(state(update_interval_ms=1000), in_grace=False, retry_ms=500)
    assert (orphan.status, orphan.pause_reason, orphan.orphaned) == (
        Status.PAUSED,
        PauseReason.NO_WORKER,
        True,
    )
    one_shot = rules.on_no_worker(state(repeat=False), in_grace=False, retry_ms=500)
    assert one_shot.status is Status.FAILED
    assert "WORK" in (one_shot.last_error or "")


def test_overdue_and_skip_to_the_next_slot() -> None:
    s = state(update_interval_ms=1000, not_after_ms=300)
    assert not rules.is_overdue(s, NOW + timedelta(milliseconds=300))
    assert rules.is_overdue(s, NOW + timedelta(milliseconds=301))
    assert not rules.is_overdue(state(repeat=False), NOW + timedelta(days=1))
    default_grace = state(update_interval_ms=1000)
    assert not rules.is_overdue(default_grace, NOW + timedelta(milliseconds=999))
    assert rules.is_overdue(default_grace, NOW + timedelta(milliseconds=1001))
    skipped = rules.on_skip(
        state(update_interval_ms=1000, missed_run=domain.MissedRun.SKIP), NOW + timedelta(seconds=3.5)
    )
    assert skipped.outcome is Outcome.SKIPPED
    assert not skipped.ran
    assert skipped.next_at == NOW + timedelta(seconds=4)
    cron_skip = rules.on_skip(state(cron="0 * * * *"), NOW + timedelta(hours=2, minutes=5))
    assert cron_skip.next_at == NOW + timedelta(hours=3)


def test_a_non_blocking_task_moves_to_its_next_slot_when_one_is_claimed() -> None:
    s = state(update_interval_ms=1000, blocking=False)
    # Claimed on time (or early, by not_before): the slot after it.
    assert rules.slot_after_claim(s, NOW) == (NOW + timedelta(seconds=1),) * 2
    assert rules.slot_after_claim(s, NOW - timedelta(milliseconds=200))[0] == NOW + timedelta(seconds=1)
    # Claimed late (downtime): this run is the one catch-up, then the cadence goes on from now.
    assert rules.slot_after_claim(s, NOW + timedelta(seconds=3.5))[0] == NOW + timedelta(seconds=4)
    early = state(update_interval_ms=1000, not_before_ms=100, blocking=False)
    assert rules.slot_after_claim(early, NOW) == (NOW + timedelta(seconds=1), NOW + timedelta(seconds=0.9))
    hourly = state(cron="0 * * * *", blocking=False)
    assert rules.slot_after_claim(hourly, NOW)[0] == NOW + timedelta(hours=1)
    assert rules.slot_after_claim(hourly, NOW - timedelta(minutes=1))[0] == NOW + timedelta(hours=1)


def test_a_non_blocking_run_keeps_the_next_slot_unless_its_failure_pushes_it_later() -> None:
    s = state(update_interval_ms=1000, blocking=False)
    success = rules.for_concurrent_run(rules.on_success(s, NOW, next_interval_ms=None, preserve=False))
    assert (success.next_at, success.delay_ms, success.ran, success.failure_count) == (None, 0, True, 0)
    skipped = rules.for_concurrent_run(rules.on_skip(s, NOW + timedelta(seconds=3.5)))
    assert (skipped.next_at, skipped.delay_ms, skipped.ran) == (None, 0, False)
    # Failures still count, back off and pause.
    failed = rules.for_concurrent_run(rules.on_failure(s, NOW, error="x", retry_at=None))
    assert (failed.failure_count, failed.update_interval_ms, failed.delay_ms) == (1, 2000, 2000)
    last = rules.for_concurrent_run(
        rules.on_failure(
            state(update_interval_ms=1000, blocking=False, failures=4), NOW, error="x", retry_at=None
        )
    )
    assert (last.status, last.pause_reason) == (Status.PAUSED, PauseReason.MAX_FAILURES)
    retry = NOW + timedelta(minutes=5)
    assert rules.for_concurrent_run(rules.on_failure(s, NOW, error="x", retry_at=retry)).next_at == retry
    waiting = rules.for_concurrent_run(rules.on_no_worker(s, in_grace=True, retry_ms=500))
    assert waiting.delay_ms == 500
    orphaned = rules.for_concurrent_run(rules.on_no_worker(s, in_grace=False, retry_ms=500))
    assert (orphaned.status, orphaned.orphaned, orphaned.delay_ms) == (Status.PAUSED, True, 0)


# --- cron --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("expression", "after", "expected"),
    [
        ("* * * * *", datetime(2025, 1, 1, 0, 0, 30, tzinfo=UTC), datetime(2025, 1, 1, 0, 1, tzinfo=UTC)),
        (
            "*/15 9-17 * * mon-fri",
            datetime(2025, 3, 8, 12, 0, tzinfo=UTC),
            datetime(2025, 3, 10, 9, 0, tzinfo=UTC),
        ),
        ("0 0 29 feb *", datetime(2025, 3, 1, tzinfo=UTC), datetime(2028, 2, 29, tzinfo=UTC)),
        ("@daily", datetime(2025, 12, 31, 23, 59, tzinfo=UTC), datetime(2026, 1, 1, tzinfo=UTC)),
        (
            "0 12 1 * 0",
            datetime(2025, 6, 2, tzinfo=UTC),
            datetime(2025, 6, 8, 12, tzinfo=UTC),
        ),  # 1st or Sunday
        ("30 4 * * 7", datetime(2025, 6, 2, tzinfo=UTC), datetime(2025, 6, 8, 4, 30, tzinfo=UTC)),
        ("0,30 1 * JAN,Jul *", datetime(2025, 2, 1, tzinfo=UTC), datetime(2025, 7, 1, 1, 0, tzinfo=UTC)),
    ],
)
def test_cron_next_firing(expression: str, after: datetime, expected: datetime) -> None:
    assert cron.parse(expression).next_after(after) == expected


def _matches_brute_force(c: cron.Cron, moment: datetime) -> bool:
    weekday = moment.isoweekday() % 7
    in_month, in_week = moment.day in c.days, weekday in c.weekdays
    day = (in_month or in_week) if (c.days_restricted and c.weekdays_restricted) else (in_month and in_week)
    return moment.minute in c.minutes and moment.hour in c.hours and moment.month in c.months and day


FIELD = st.one_of(
    st.just("*"),
    st.integers(1, 20).map(lambda n: f"*/{n}"),
    st.tuples(st.integers(1, 5), st.integers(1, 5)).map(lambda ab: f"{min(ab)}-{max(ab) + 3}"),
    st.lists(st.integers(1, 6), min_size=1, max_size=3).map(lambda xs: ",".join(map(str, xs))),
)


@settings(max_examples=150, deadline=None)
@given(
    minute=FIELD,
    hour=FIELD,
    day=FIELD,
    weekday=st.one_of(st.just("*"), st.integers(0, 7).map(str), st.just("1-5")),
    offset=st.integers(0, 60 * 24 * 40),
)
def test_cron_next_is_the_first_matching_minute(
    minute: str, hour: str, day: str, weekday: str, offset: int
) -> None:
    c = cron.parse(f"{minute} {hour} {day} * {weekday}")
    after = datetime(2025, 1, 1, tzinfo=UTC) + timedelta(minutes=offset, seconds=17)
    found = c.next_after(after)
    assert found > after
    assert found.second == 0
    assert _matches_brute_force(c, found)
    probe = after.replace(second=0) + timedelta(minutes=1)
    # No earlier minute matches (checked within a bounded window for speed).
    while probe < found and probe < after + timedelta(days=3):
        assert not _matches_brute_force(c, probe), probe
        probe += timedelta(minutes=1)


@pytest.mark.parametrize(
    ("expression", "part"),
    [("", "5 fields"), ("a * * * *", "minute"), ("* 24 * * *", "hour"), ("* * 0 * *", "day of month"),
     ("* * * 13 *", "month"), ("* * * * 8", "day of week"), ("* * * * mon/0", "step"),
     ("1,,2 * * * *", "empty")],
)  # fmt: skip
def test_cron_errors_say_which_part(expression: str, part: str) -> None:
    with pytest.raises(cron.CronError) as caught:
        cron.parse(expression)
    assert part in str(caught.value)


# --- stored tasks -----------------------------------------------------------------------------------


def stored(
    *, repeat: bool = True, lease: domain.Lease | None = None, live_runs: int = 0, **schedule: object
) -> domain.Task:
    return domain.Task(
        id=uuid.uuid4(),
        agent_id=uuid.uuid4(),
        name="WORK",
        description="",
        tags=("queue", "repeat") if repeat else ("queue",),
        room_id=None,
        world_id=None,
        entity_id=None,
        due_at=None,
        schedule=Schedule(**schedule),  # type: ignore[arg-type]
        values={},
        status=Status.RUNNING if lease else Status.ACTIVE,
        pause_reason=None,
        failure_count=0,
        last_error=None,
        last_run_at=NOW - timedelta(seconds=30),
        run_count=1,
        next_run_at=NOW,
        ready_at=NOW,
        orphaned_no_worker=False,
        attempt=1 if lease else 0,
        lease=lease,
        revision=1,
        created_at=NOW - timedelta(hours=1),
        updated_at=NOW,
        read_at=NOW,
        live_runs=live_runs,
    )


def test_a_lease_is_shown_and_executing_only_while_live() -> None:
    live = domain.Lease("replica", 7, NOW + timedelta(seconds=1))
    expired = domain.Lease("replica", 7, NOW)
    assert stored(lease=live, update_interval_ms=1000).live_lease == live
    assert stored(lease=live, update_interval_ms=1000).executing
    assert stored(lease=expired, update_interval_ms=1000).live_lease is None
    assert not stored(lease=expired, update_interval_ms=1000).executing
    assert stored(live_runs=2, update_interval_ms=1000, blocking=False).executing
    assert stored(update_interval_ms=1000).state.next_run_at == NOW


def test_an_edited_schedule_runs_next_from_the_last_run_or_the_new_due_time() -> None:
    task = stored(update_interval_ms=60_000)
    every_minute = Schedule(update_interval_ms=60_000)
    every_hour_cron = Schedule(cron="0 * * * *")
    later = NOW + timedelta(days=1)
    after_last = task.last_run_at + timedelta(minutes=1)  # type: ignore[operator]
    assert (
        rules.rescheduled(task, every_minute, repeat=True, due_at=None, due_changed=False, now=NOW)
        == after_last
    )
    assert (
        rules.rescheduled(task, every_minute, repeat=True, due_at=later, due_changed=True, now=NOW) == later
    )
    assert rules.rescheduled(task, every_hour_cron, repeat=True, due_at=None, due_changed=False, now=NOW) == (
        NOW + timedelta(hours=1)
    )
    one_shot = Schedule()
    assert rules.rescheduled(task, one_shot, repeat=False, due_at=None, due_changed=False, now=NOW) == NOW
