"""plan: the prompt (stable segments first), the model's answer parsed as the ``<response>``
contract; when the answer names providers it wants, they are consulted and the model asked once
more."""

from __future__ import annotations

from ...parser import ParsedResponse, parse_or_plain
from ..pipeline import Stage, Stop
from ..ports import Model
from ..prompt import build_turn_prompt, join_segments
from ..state import Turn, TurnMetrics
from .compose import gather


class Plan(Stage):
    name = "plan"

    def __init__(
        self, model: Model, metrics: TurnMetrics, *, provider_timeout: float, trajectory_logging: bool
    ) -> None:
        self.model = model
        self.metrics = metrics
        self.provider_timeout = provider_timeout
        self.trajectory_logging = trajectory_logging

    async def run(self, turn: Turn) -> Stop | None:
        agent, ctx = turn.agent, turn.ctx
        parsed = await self._ask(turn)
        wanted = [p for name in parsed.providers if (p := agent.catalog.provider(name)) is not None]
        if wanted:
            extra = await gather(
                wanted, ctx, timeout=self.provider_timeout, metrics=self.metrics, redactor=agent.redactor
            )
            ctx.state.texts.update(extra.texts)
            ctx.state.values.update(extra.values)
            ctx.state.data.update(extra.data)
            turn.trajectory["re_ask"] = {
                "providers": [p.name for p in wanted],
                "first_output": turn.raw_output[:4000],
            }
            parsed = await self._ask(turn)
        ctx.parsed = parsed
        return None

    async def _ask(self, turn: Turn) -> ParsedResponse:
        agent, ctx = turn.agent, turn.ctx
        segments = build_turn_prompt(agent.character, ctx.state, ctx.message.sender_name, ctx.message.text)
        if join_segments(segments) != "".join(s.content for s in segments):  # the gateway checks it too
            raise AssertionError("prompt segments do not join to the prompt")
        raw = await self.model.generate(agent.id, segments)
        turn.raw_output = raw
        if self.trajectory_logging:
            turn.trajectory["providers"] = dict(ctx.state.texts)
            turn.trajectory["segments"] = [{"stable": s.stable, "content": s.content} for s in segments]
        turn.trajectory["raw_output"] = raw[:16000]
        parsed = parse_or_plain(raw)
        turn.trajectory["parsed"] = {
            "actions": parsed.actions,
            "providers": parsed.providers,
            "thought": parsed.thought,
            "text": parsed.text,
        }
        return parsed
