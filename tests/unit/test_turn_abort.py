"""A turn's ``Abort``: what the turn awaits under ``guard`` is cancelled where it waits when the
turn is stopped (a cancel, a newer message in its room), and only then does ``guard`` say
``Aborted``; any other cancellation (a shutdown) stays a cancellation."""

from __future__ import annotations

import asyncio

import pytest

from parley_runtime.turn.streaming import CANCELLED, SUPERSEDED, Abort, Aborted


class Work:
    def __init__(self) -> None:
        self.started = asyncio.Event()
        self.release = asyncio.Event()
        self.cleaned_up = False

    async def __call__(self, value: str = "done") -> str:
        self.started.set()
        try:
            await self.release.wait()
        except asyncio.CancelledError:
            self.cleaned_up = True  # a model stream sends its cancel here
            raise
        return value


async def test_work_that_ends_gives_its_result() -> None:
    abort, work = Abort(), Work()
    work.release.set()
    assert await abort.guard(work("answer")) == "answer"
    assert abort.outcome is None


async def test_an_abort_cancels_the_work_where_it_waits_and_says_why() -> None:
    abort, work = Abort(), Work()
    guarded = asyncio.create_task(abort.guard(work()))
    await work.started.wait()
    assert abort.request(SUPERSEDED, "a newer message arrived in the room")
    with pytest.raises(Aborted) as aborted:
        await guarded
    assert aborted.value.outcome == SUPERSEDED
    assert aborted.value.reason == "a newer message arrived in the room"
    assert work.cleaned_up
    assert guarded.cancelling() == 0  # the abort's cancel is spent: later timeouts work as usual
    assert not abort.request(CANCELLED, "too late")  # set once


async def test_a_shutdown_during_the_work_stays_a_cancellation() -> None:
    abort, work = Abort(), Work()
    guarded = asyncio.create_task(abort.guard(work()))
    await work.started.wait()
    guarded.cancel()
    with pytest.raises(asyncio.CancelledError):
        await guarded
    assert work.cleaned_up


async def test_an_abort_and_a_shutdown_together_stay_a_cancellation() -> None:
    abort, work = Abort(), Work()
    guarded = asyncio.create_task(abort.guard(work()))
    await work.started.wait()
    abort.request(CANCELLED, "cancelled by the user")
    guarded.cancel()
    with pytest.raises(asyncio.CancelledError):
        await guarded


async def test_an_abort_before_the_guard_never_starts_the_work() -> None:
    abort, work = Abort(), Work()
    abort.request(CANCELLED, "cancelled by the user")
    with pytest.raises(Aborted):
        await abort.guard(work())
    assert not work.started.is_set()


async def test_work_that_swallows_the_cancel_still_ends_the_turn_aborted() -> None:
    abort = Abort()
    started = asyncio.Event()

    async def stubborn() -> str:
        started.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            return "finished anyway"
        return "unreachable"

    guarded = asyncio.create_task(abort.guard(stubborn()))
    await started.wait()
    abort.request(CANCELLED, "cancelled by the user")
    with pytest.raises(Aborted):
        await guarded
    assert guarded.cancelling() == 0


async def test_a_sealed_turn_is_not_aborted() -> None:
    abort, work = Abort(), Work()
    assert abort.seal() is None  # delivering: too late to stop
    assert not abort.request(CANCELLED, "too late")
    work.release.set()
    assert await abort.guard(work()) == "done"
