"""Proof that a race happened: the racing calls were in flight at the same time.

A race test that counts one winner proves nothing if the calls ran one after another. Each racer
waits at a barrier, then records when its call started and ended with ``time.monotonic()``
(CLOCK_MONOTONIC: one clock for every process on the machine, so spans from separate racing
processes compare). The calls overlapped when more than one started before the first finished.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Iterable
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class Span:
    start: float
    end: float


async def timed(call: Awaitable[T]) -> tuple[T, Span]:
    start = time.monotonic()
    result = await call
    return result, Span(start, time.monotonic())


def in_flight_together(spans: Iterable[Span]) -> int:
    """How many calls had started before the first one finished (the first included)."""
    spans = list(spans)
    first_end = min(span.end for span in spans)
    return sum(1 for span in spans if span.start < first_end)


def assert_raced(spans: Iterable[Span], what: str) -> int:
    spans = list(spans)
    together = in_flight_together(spans)
    assert together >= 2, (
        f"{what}: only {together} of {len(spans)} calls had started before the first one finished; "
        "the calls did not overlap, so the race did not happen"
    )
    return together
