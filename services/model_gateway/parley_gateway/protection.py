"""What stands between callers and a provider: a concurrency limit with a bounded queue, retries
with backoff and jitter, and a circuit breaker. All of it is per provider and in-process; the
token budget, which must hold across replicas, lives in PostgreSQL (see ``store.py``)."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

from parley_platform import codes
from parley_platform.errors import ParleyError
from parley_platform.retry import Backoff

from . import errors
from .provider import ProviderRateLimited

T = TypeVar("T")


class Limiter:
    """At most ``limit`` calls at once; up to ``queue_limit`` more wait their turn (first come,
    first served), the rest are refused. A free slot is taken without waiting for anything."""

    def __init__(self, provider: str, limit: int, queue_limit: int) -> None:
        self.provider = provider
        self.limit = limit
        self.queue_limit = queue_limit
        self._slot = _Slot(self)
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()
        self.inflight = 0
        self.queued = 0

    def slot(self) -> _Slot:
        """``async with limiter.slot():`` holds one of the slots while the call runs."""
        return self._slot

    def try_acquire(self) -> bool:
        """Takes a free slot at once, when one is free and nobody waits before this call."""
        if self.inflight < self.limit and not self._waiters:
            self.inflight += 1
            return True
        return False

    async def acquire(self) -> None:
        if self.try_acquire():
            return
        if self.queued >= self.queue_limit:
            raise errors.PROVIDER_BUSY(
                f"provider {self.provider} is busy: {self.inflight} calls running, {self.queued} queued"
            )
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        self.queued += 1
        try:
            await waiter  # release() hands its slot over: ``inflight`` already counts this call
        except BaseException:
            if waiter.done() and not waiter.cancelled():
                self.release()  # given a slot as it was cancelled: the next in line takes it
            else:
                with contextlib.suppress(ValueError):
                    self._waiters.remove(waiter)
            raise
        finally:
            self.queued -= 1

    def release(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return
        self.inflight -= 1


class _Slot:
    """The limiter's slot as an async context manager. A plain class, not ``@asynccontextmanager``:
    a generator per call cost the gateway's hot path more than the limit itself. It holds no
    state of its own, so every call shares one."""

    def __init__(self, limiter: Limiter) -> None:
        self.limiter = limiter

    async def __aenter__(self) -> None:
        await self.limiter.acquire()

    async def __aexit__(self, *exc: object) -> None:
        self.limiter.release()


class CircuitBreaker:
    """Closed → open after ``threshold`` consecutive provider failures; open refuses calls for
    ``reset_seconds``; then half-open lets one trial call through, whose outcome closes or reopens it."""

    def __init__(
        self, provider: str, threshold: int, reset_seconds: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.provider = provider
        self.threshold = threshold
        self.reset_seconds = reset_seconds
        self.clock = clock
        self.failures = 0
        self.opened_at: float | None = None
        self._trial = False

    @property
    def state(self) -> str:
        if self.opened_at is None:
            return "closed"
        if self.clock() - self.opened_at >= self.reset_seconds:
            return "half_open"
        return "open"

    def admit(self) -> None:
        state = self.state
        if state == "closed":
            return
        if state == "half_open" and not self._trial:
            self._trial = True
            return
        assert self.opened_at is not None
        wait = max(0.0, self.reset_seconds - (self.clock() - self.opened_at))
        raise errors.CIRCUIT_OPEN(
            f"provider {self.provider} is failing; its circuit is open",
            hint=f"the gateway tries it again in {wait:.1f}s; see `parley models list`",
        )

    def success(self) -> None:
        self.failures = 0
        self.opened_at = None
        self._trial = False

    def failure(self) -> None:
        self.failures += 1
        if self._trial or self.failures >= self.threshold:
            self.opened_at = self.clock()
        self._trial = False

    def release(self) -> None:
        """The call ended without saying anything about the provider (cancelled, the caller's fault)."""
        self._trial = False


@dataclass(frozen=True)
class RetryPolicy:
    attempts: int = 3  # in all, the first included
    base_delay: float = 0.2
    max_delay: float = 5.0

    @property
    def backoff(self) -> Backoff:
        return Backoff(self.base_delay, self.max_delay, jitter=True)

    def delay(self, attempt: int, error: ParleyError, rng: random.Random) -> float:
        """Full jitter on an exponential ceiling; a provider's Retry-After is a floor."""
        wait = self.backoff.delay(attempt, rng)
        if isinstance(error, ProviderRateLimited) and error.retry_after is not None:
            wait = max(wait, error.retry_after)
        return wait


def counts_against_provider(error: BaseException) -> bool:
    """Failures that say the provider is unwell (not the caller's bad input, not the queue)."""
    return isinstance(error, ParleyError) and error.retryable and not errors.PROVIDER_BUSY.matches(error)


async def with_retries(
    call: Callable[[float], Awaitable[T]],
    *,
    policy: RetryPolicy,
    deadline: float,
    breaker: CircuitBreaker,
    rng: random.Random,
    on_retry: Callable[[ParleyError], None] = lambda _e: None,
) -> T:
    """Run ``call(remaining_seconds)`` through the breaker, retrying retryable failures until the
    attempts or the caller's deadline (a ``time.monotonic()`` value) run out."""
    attempt = 0
    while True:
        attempt += 1
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise codes.DEADLINE_EXCEEDED("the caller's deadline passed before the provider answered")
        breaker.admit()
        try:
            result = await call(remaining)
        except ParleyError as exc:
            if counts_against_provider(exc):
                breaker.failure()
            else:
                breaker.release()
            if not exc.retryable or attempt >= policy.attempts:
                raise
            wait = policy.delay(attempt, exc, rng)
            if time.monotonic() + wait >= deadline:
                raise
            on_retry(exc)
            await asyncio.sleep(wait)
            continue
        except BaseException:
            breaker.release()
            raise
        breaker.success()
        return result
