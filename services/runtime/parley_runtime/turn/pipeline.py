"""The turn as a pipeline of stages, and the one runner that runs them.

A stage is one step of a turn (``turn/stages/``). The runner times every stage (the
``parley_turn_stage_duration_seconds`` metric and the trajectory's ``stages`` entry) and stops
early when a stage says the turn is decided:

- ``Stop.finished(outcome)``: the turn is over (ignored, superseded, ...); no stage runs after it;
- ``Stop.answered()``: what the turn says is known (a pairing challenge instead of an answer);
  the remaining stages are skipped up to the *closing* ones (``deliver``, ``after_reply``).

Adding a stage is one module and one line in the list the processor builds.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from .state import Turn, TurnMetrics


@dataclass(frozen=True)
class Stop:
    outcome: str | None  # None: go on with the closing stages

    @classmethod
    def finished(cls, outcome: str) -> Stop:
        return cls(outcome)

    @classmethod
    def answered(cls) -> Stop:
        return cls(None)


class Stage:
    """One step of a turn. ``name`` labels its metric and trajectory entry; a ``closing`` stage
    runs even when an earlier stage answered early."""

    name: ClassVar[str]
    closing: ClassVar[bool] = False

    async def run(self, turn: Turn) -> Stop | None:
        raise NotImplementedError


class Pipeline:
    def __init__(self, stages: Sequence[Stage], metrics: TurnMetrics, *, record: bool) -> None:
        names = [s.name for s in stages]
        if len(set(names)) != len(names):
            raise ValueError(f"stage names repeat: {names}")
        self.stages = tuple(stages)
        self.metrics = metrics
        # Each stage's histogram child found once (``labels()`` locks and hashes on every call).
        self.timers = {name: metrics.stage.labels(name) for name in names}
        self.record = record  # trajectory logging

    async def run(self, turn: Turn) -> str:
        """Run the stages in order; the outcome is the one a stage finished with, else the one the
        closing stages set (``turn.outcome``)."""
        answered = False
        timings: list[dict[str, object]] = []
        if self.record:
            turn.trajectory["stages"] = timings
        for stage in self.stages:
            if answered and not stage.closing:
                continue
            started = time.perf_counter()
            try:
                stop = await stage.run(turn)
            finally:
                elapsed = time.perf_counter() - started
                self.timers[stage.name].observe(elapsed)
                timings.append({"stage": stage.name, "ms": round(elapsed * 1000, 3)})
            if stop is None:
                continue
            if stop.outcome is not None:
                return stop.outcome
            answered = True
        if turn.outcome is None:
            raise RuntimeError("the turn's stages ended without an outcome (is `deliver` in the list?)")
        return turn.outcome
