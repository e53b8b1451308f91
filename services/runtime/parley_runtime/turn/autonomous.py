"""The pipeline of autonomous turns: the message turn's gate, then ``think`` (the think section's
answer as the plan), then the same post-model stages as a message turn (act, confirm, deliver,
after_reply). It counts its turns by outcome (``parley_autonomous_turns_total``)."""

from __future__ import annotations

from collections.abc import Sequence

from .pipeline import Pipeline, Stage
from .stages.think import Think
from .state import Turn, TurnMetrics

AFTER_MODEL = ("act", "confirm", "deliver", "after_reply")


class AutonomousPipeline(Pipeline):
    async def run(self, turn: Turn) -> str:
        outcome = await super().run(turn)
        self.metrics.autonomous.labels(outcome).inc()
        return outcome


def autonomous_pipeline(message_stages: Sequence[Stage], metrics: TurnMetrics, *, record: bool) -> Pipeline:
    by_name = {stage.name: stage for stage in message_stages}
    stages = [by_name["gate"], Think(), *(by_name[name] for name in AFTER_MODEL)]
    return AutonomousPipeline(stages, metrics, record=record)
