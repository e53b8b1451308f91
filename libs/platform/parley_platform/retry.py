"""One retry policy: exponential backoff with an optional full jitter, and a loop that retries
only what the error itself says is retryable (``ParleyError.retryable``)."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

from .errors import ParleyError

T = TypeVar("T")


def retryable(exc: BaseException) -> bool:
    return isinstance(exc, ParleyError) and exc.retryable


@dataclass(frozen=True)
class Backoff:
    """``base * 2**(attempt - 1)`` seconds, at most ``cap``; with ``jitter`` a uniform draw below it."""

    base: float
    cap: float
    jitter: bool = False

    def delay(self, attempt: int, rng: random.Random | None = None) -> float:
        ceiling = float(min(self.cap, self.base * 2 ** max(0, attempt - 1)))
        return (rng or random).uniform(0, ceiling) if self.jitter else ceiling


async def retrying(
    call: Callable[[], Awaitable[T]],
    *,
    attempts: int,
    backoff: Backoff,
    retry_if: Callable[[BaseException], bool] = retryable,
) -> T:
    """Run ``call`` up to ``attempts`` times in all; the last failure, or one not to retry, is raised."""
    attempt = 1
    while True:
        try:
            return await call()
        except Exception as exc:
            if attempt >= attempts or not retry_if(exc):
                raise
        await asyncio.sleep(backoff.delay(attempt))
        attempt += 1
