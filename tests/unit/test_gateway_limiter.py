"""The gateway's per-provider concurrency limit (``protection.Limiter``): a free slot is taken at
once, callers beyond the limit wait first come first served up to the queue limit, the rest are
refused, and a caller that gives up while waiting neither keeps nor loses a slot. Also the budget
check every call makes before it (``Budgets.may_limit``)."""

from __future__ import annotations

import asyncio
import time

import pytest

from parley_gateway.engine import Budgets
from parley_gateway.protection import Limiter
from parley_platform.errors import ParleyError


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_slots_are_taken_then_queued_in_order_then_refused() -> None:
    limiter = Limiter("p", 2, 2)
    await limiter.acquire()
    await limiter.acquire()
    order: list[int] = []

    async def wait(i: int) -> None:
        await limiter.acquire()
        order.append(i)

    waiting = [asyncio.create_task(wait(i)) for i in range(2)]
    await settle()
    assert (limiter.inflight, limiter.queued, order) == (2, 2, [])
    with pytest.raises(ParleyError) as refused:
        await limiter.acquire()
    assert refused.value.code == "PROVIDER_BUSY"
    limiter.release()
    await settle()
    assert (limiter.inflight, limiter.queued, order) == (2, 1, [0])
    limiter.release()
    await asyncio.gather(*waiting)
    assert (limiter.inflight, limiter.queued, order) == (2, 0, [0, 1])
    limiter.release()
    limiter.release()
    assert limiter.inflight == 0


async def test_a_free_slot_goes_to_the_queue_before_a_newcomer() -> None:
    limiter = Limiter("p", 1, 4)
    await limiter.acquire()
    first = asyncio.create_task(limiter.acquire())
    await settle()
    limiter.release()  # handed to the waiting caller, not left for whoever asks next
    newcomer = asyncio.create_task(limiter.acquire())
    await settle()
    assert first.done()
    assert not newcomer.done()
    assert (limiter.inflight, limiter.queued) == (1, 1)
    limiter.release()
    await newcomer
    limiter.release()
    assert (limiter.inflight, limiter.queued) == (0, 0)


async def test_a_waiter_cancelled_before_its_turn_leaves_the_queue() -> None:
    limiter = Limiter("p", 1, 4)
    await limiter.acquire()
    gone = asyncio.create_task(limiter.acquire())
    stays = asyncio.create_task(limiter.acquire())
    await settle()
    gone.cancel()
    await asyncio.gather(gone, return_exceptions=True)
    assert (limiter.inflight, limiter.queued) == (1, 1)
    limiter.release()
    await stays
    limiter.release()
    assert (limiter.inflight, limiter.queued) == (0, 0)


async def test_a_waiter_cancelled_as_it_is_given_the_slot_passes_it_on() -> None:
    limiter = Limiter("p", 1, 4)
    await limiter.acquire()
    gone = asyncio.create_task(limiter.acquire())
    stays = asyncio.create_task(limiter.acquire())
    await settle()
    limiter.release()  # the slot is handed to `gone`...
    gone.cancel()  # ...which is cancelled before it runs again
    await asyncio.gather(gone, return_exceptions=True)
    await asyncio.wait_for(stays, 1)  # the next in line got it
    assert (limiter.inflight, limiter.queued) == (1, 0)
    limiter.release()
    assert limiter.inflight == 0


async def test_try_acquire_takes_only_a_free_slot_nobody_waits_for() -> None:
    limiter = Limiter("p", 1, 4)
    assert limiter.try_acquire()
    assert not limiter.try_acquire()  # full
    waiting = asyncio.create_task(limiter.acquire())
    await settle()
    limiter.release()  # handed to the caller waiting, not left free
    assert not limiter.try_acquire()
    await waiting
    assert (limiter.inflight, limiter.queued) == (1, 0)
    limiter.release()
    assert limiter.try_acquire()
    limiter.release()
    assert limiter.inflight == 0


def test_a_reservation_is_asked_for_only_while_the_agent_may_have_a_budget() -> None:
    budgets = Budgets(None, default_tokens=0, window_seconds=3600, cache_seconds=5)  # type: ignore[arg-type]
    assert not budgets.may_limit("")  # no agent: nothing to limit
    assert budgets.may_limit("ada")  # not known yet: ask the database
    budgets._unbudgeted["ada"] = time.monotonic() + 5  # the database said: no budget
    assert not budgets.may_limit("ada")
    budgets._unbudgeted["ada"] = time.monotonic() - 1  # trusted for cache_seconds only
    assert budgets.may_limit("ada")
    budgets._unbudgeted["ada"] = time.monotonic() + 5
    budgets.forget("ada")  # its budget changed
    assert budgets.may_limit("ada")
