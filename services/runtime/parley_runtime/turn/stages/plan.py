"""plan: the prompt (stable segments first), the model's answer parsed as the ``<response>``
contract; when the answer names providers it wants, they are consulted and the model asked once
more.

The first answer is streamed: its reply text goes out as stream chunks while the model writes
(``textstream`` decides what may go). A cancel or a newer message in the room stops the
generation (the gateway closes its provider's stream) and ends the turn as cancelled or
superseded, with no reply."""

from __future__ import annotations

from ...parser import ParsedResponse, parse_or_plain
from ...store import RuntimeStore
from ..pipeline import Stage, Stop
from ..ports import Model
from ..prompt import Segment, build_turn_prompt, join_segments
from ..state import Turn, TurnMetrics
from ..streaming import Aborted
from ..textstream import TextStream
from .compose import gather


class Plan(Stage):
    name = "plan"

    def __init__(
        self,
        model: Model,
        store: RuntimeStore,
        metrics: TurnMetrics,
        *,
        provider_timeout: float,
        trajectory_logging: bool,
    ) -> None:
        self.model = model
        self.store = store
        self.metrics = metrics
        self.provider_timeout = provider_timeout
        self.trajectory_logging = trajectory_logging

    async def run(self, turn: Turn) -> Stop | None:
        try:
            return await self._plan(turn)
        except Aborted as aborted:
            turn.trajectory["aborted"] = aborted.reason
            await self.store.finish_turn(
                turn.agent.id,
                turn.id,
                aborted.outcome,
                lease_token=turn.lease_token,
                reason=aborted.reason,
                trajectory=turn.recorded(self.trajectory_logging),
            )
            self.metrics.aborted.labels(aborted.outcome).inc()
            return Stop.finished(aborted.outcome)

    async def _plan(self, turn: Turn) -> Stop | None:
        agent, ctx = turn.agent, turn.ctx
        parsed = await self._ask(turn, stream=True)
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
            parsed = await self._ask(turn, stream=False)
        ctx.parsed = parsed
        return None

    async def _ask(self, turn: Turn, *, stream: bool) -> ParsedResponse:
        agent, ctx = turn.agent, turn.ctx
        segments = build_turn_prompt(agent.character, ctx.state, ctx.message.sender_name, ctx.message.text)
        if join_segments(segments) != "".join(s.content for s in segments):  # the gateway checks it too
            raise AssertionError("prompt segments do not join to the prompt")
        if stream and turn.stream is not None:
            raw = await turn.abort.guard(self._stream(turn, segments))
        else:
            raw = await turn.abort.guard(self.model.generate(agent.id, segments))
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

    async def _stream(self, turn: Turn, segments: list[Segment]) -> str:
        """The model's whole answer; its reply text published as it comes."""
        assert turn.stream is not None
        writer = turn.stream
        writer.opened = True
        text = TextStream(turn.agent.redactor)
        pieces: list[str] = []
        whole: str | None = None
        async for chunk in self.model.stream(turn.agent.id, segments):
            # Read on to the stream's end, which follows the last chunk at once: leaving before it
            # would cancel the finished call on the gateway (one more message each way).
            if chunk.done:
                whole = chunk.response.text
            elif whole is None:
                pieces.append(chunk.text)
                await writer.send(text.feed(chunk.text))
        return "".join(pieces) if whole is None else whole
