"""``Deadlines.within``: many awaits bounded by one timer, each cancelled once its own deadline passes,
and a cancellation from elsewhere never mistaken for a deadline."""

from __future__ import annotations

import asyncio
import time

import pytest

from parley_platform.deadlines import DeadlinePassed, Deadlines
from parley_platform.testing import eventually

TICK = 0.01


async def test_each_await_is_bounded_by_its_own_deadline() -> None:
    deadlines = Deadlines(tick=TICK)
    release = asyncio.Event()

    async def waits(seconds: float) -> str:
        started = time.monotonic()
        try:
            await deadlines.within(seconds, release.wait())
        except DeadlinePassed:
            late = time.monotonic() - started - seconds
            assert -0.001 <= late < 1.0, late  # at most a tick late on a quiet machine; bounded here
            return "passed"
        return "answered"

    short = [asyncio.create_task(waits(0.03)) for _ in range(40)]
    long = [asyncio.create_task(waits(30)) for _ in range(40)]
    assert [await t for t in short] == ["passed"] * 40
    assert len(deadlines) == 40  # the long ones, still waiting
    release.set()
    assert [await t for t in long] == ["answered"] * 40
    assert len(deadlines) == 0

    async def timer_stopped() -> bool:
        return deadlines._timer is None

    # No timer while nothing waits: the last tick finds nothing registered and does not re-arm.
    await eventually(timer_stopped, timeout=5, interval=TICK, what="the deadline timer stopped")


async def test_a_cancellation_from_elsewhere_is_not_a_deadline() -> None:
    deadlines = Deadlines(tick=TICK)
    started = asyncio.Event()

    async def waits() -> None:
        started.set()
        await deadlines.within(30, asyncio.Event().wait())

    task = asyncio.create_task(waits())
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert task.cancelled()
    assert len(deadlines) == 0


async def test_a_deadline_and_a_cancellation_together_leave_the_cancellation() -> None:
    deadlines = Deadlines(tick=60)  # checked by hand below, not by its timer
    seen: list[int] = []

    async def waits() -> None:
        try:
            await deadlines.within(0.0, asyncio.Event().wait())
        finally:
            seen.append(asyncio.current_task().cancelling())  # type: ignore[union-attr]

    task = asyncio.create_task(waits())
    await asyncio.sleep(0)  # registered, and waiting
    # The deadline's cancellation and another before the task runs again: one CancelledError.
    deadlines._check(asyncio.get_running_loop())
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert seen == [1]  # ours taken back, the other one still requested
    assert len(deadlines) == 0


async def test_work_that_swallows_the_cancellation_is_heard_and_the_task_is_not_left_cancelling() -> None:
    deadlines = Deadlines(tick=TICK)

    async def stubborn(answer: object) -> object:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            if isinstance(answer, Exception):
                raise answer from None
            return answer
        raise AssertionError("not reached")

    async def run(answer: object) -> tuple[object, int]:
        try:
            result: object = await deadlines.within(0.02, stubborn(answer))
        except ValueError as exc:
            result = exc
        return result, asyncio.current_task().cancelling()  # type: ignore[union-attr]

    assert await asyncio.create_task(run("late answer")) == ("late answer", 0)
    error = ValueError("its own")
    assert await asyncio.create_task(run(error)) == (error, 0)


async def test_within_is_a_timeout_error_like_asyncio_timeout() -> None:
    deadlines = Deadlines(tick=TICK)
    with pytest.raises(TimeoutError):
        await deadlines.within(0.01, asyncio.sleep(5))
    assert await deadlines.within(5, asyncio.sleep(0, result="done")) == "done"
