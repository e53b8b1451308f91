"""The gateway's per-provider concurrency limit (``protection.Limiter``): a free slot is taken at
once, callers beyond the limit wait first come first served up to the queue limit, the rest are
refused, and a caller that gives up while waiting neither keeps nor loses a slot."""

from __future__ import annotations

import asyncio

import pytest

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
