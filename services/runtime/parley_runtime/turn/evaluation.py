"""The evaluators of a turn, after its reply: every evaluator with a prompt segment is one section
of the turn's affinity (``room:<id>``) in the model gateway's prompt batcher, registered together
and drained once, so they share one model call (after a short window in which a drain by someone
else, e.g. for the room's previous turn, may answer them with other turns' sections); each gets
its own fields back, or its fallback when the batcher could not get a valid answer for it (the
batcher retries a section first). An evaluator without a segment runs its handler on its own.
None of them can fail the turn."""

from __future__ import annotations

import contextlib
import re
import secrets
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from parley.v1 import model_pb2
from parley_clients.batcher import BatcherClient, Field
from parley_platform.bus import Bus
from parley_platform.errors import ParleyError
from parley_platform.logging import get_logger

from ..sdk import Evaluator, EvaluatorPrompt, TurnContext
from .state import Turn

log = get_logger(__name__)

SECTION_NAME = re.compile(r"[^A-Za-z0-9_-]")
Batchers = Callable[[uuid.UUID], BatcherClient]


def section_id(turn_id: uuid.UUID, evaluator: str) -> str:
    """Unique per turn and evaluator; a retried turn registers the same ids (a duplicate is refused)."""
    return f"ev-{turn_id.hex}-{SECTION_NAME.sub('_', evaluator)}"[:64]


def affinity(room_id: uuid.UUID) -> str:
    return f"room:{room_id}"


def fields_of(specs: Sequence[str]) -> list[Field]:
    out = []
    for spec in specs:
        name, _, description = spec.partition(":")
        out.append(Field(name.strip(), description.strip()))
    return out


class EvaluatorBatchers:
    """One batcher client per agent on this replica (each listens for its agent's results)."""

    def __init__(self, bus: Bus, *, timeout: float) -> None:
        self.bus = bus
        self.timeout = timeout
        self.owner = f"evaluators-{secrets.token_hex(6)}"
        self._clients: dict[uuid.UUID, BatcherClient] = {}

    def __call__(self, agent_id: uuid.UUID) -> BatcherClient:
        client = self._clients.get(agent_id)
        if client is None:
            client = BatcherClient(self.bus, str(agent_id), owner=self.owner, timeout=self.timeout)
            self._clients[agent_id] = client
        return client

    async def close(self) -> None:
        """Remove what this replica's evaluators left registered, and stop listening."""
        clients, self._clients = list(self._clients.values()), {}
        for client in clients:
            with contextlib.suppress(ParleyError):
                await client.dispose()


class Evaluations:
    def __init__(self, batchers: Batchers | None, *, timeout: float, window: float = 0.0) -> None:
        self.batchers = batchers
        self.timeout = timeout
        self.window = window

    async def run(self, turn: Turn) -> dict[str, Any]:
        """Each evaluator's result (or failure), by name, as the trajectory records it."""
        agent, ctx = turn.agent, turn.ctx
        results: dict[str, Any] = {}
        due: list[Evaluator] = []
        for evaluator in agent.catalog.evaluators:
            try:
                if evaluator.validate is None or await evaluator.validate(ctx):
                    due.append(evaluator)
            except Exception as exc:
                results[evaluator.name] = self._failed(turn, evaluator, exc)
        segments: dict[str, tuple[Evaluator, EvaluatorPrompt]] = {}
        if self.batchers is not None:
            for evaluator in (e for e in due if e.batched):
                try:
                    segment = await evaluator.segment(ctx)  # type: ignore[misc]
                except Exception as exc:
                    results[evaluator.name] = self._failed(turn, evaluator, exc)
                    continue
                if segment is not None:
                    segments[evaluator.name] = (evaluator, segment)
        if segments:
            results.update(await self._batched(turn, ctx, segments))
        for evaluator in due:
            if evaluator.name in segments or evaluator.name in results:
                continue
            try:
                result = await evaluator.handler(ctx)
                results[evaluator.name] = result.to_json() if result else None
            except Exception as exc:
                results[evaluator.name] = self._failed(turn, evaluator, exc)
        return results

    async def _batched(
        self, turn: Turn, ctx: TurnContext, segments: Mapping[str, tuple[Evaluator, EvaluatorPrompt]]
    ) -> dict[str, Any]:
        assert self.batchers is not None
        client = self.batchers(turn.agent.id)
        where = affinity(turn.room_id)
        sections = {
            name: client.section(
                section_id(turn.id, name),
                segment.prompt,
                fields_of(segment.fields),
                affinity=where,
                priority=model_pb2.SECTION_PRIORITY_NORMAL,
                fallback=segment.fallback,
                model_type=model_pb2.MODEL_TYPE_TEXT_LARGE
                if segment.large
                else model_pb2.MODEL_TYPE_TEXT_SMALL,
                max_retries=1,
            )
            for name, (_, segment) in segments.items()
        }
        answered = await client.ask_together(
            list(sections.values()), affinity=where, timeout=self.timeout + self.window, window=self.window
        )
        results: dict[str, Any] = {}
        for name, (evaluator, _) in segments.items():
            answer = answered[sections[name].id]
            batch = {
                "fallback_used": answer.fallback_used,
                "attempts": answer.attempts,
                "section": answer.section_id,
            }
            if answer.error:
                batch["error"] = answer.error[:200]
            try:
                result = await evaluator.apply(ctx, dict(answer.fields), answer.fallback_used)  # type: ignore[misc]
                results[name] = {**(result.to_json() if result else {}), "batch": batch}
            except Exception as exc:
                results[name] = {**self._failed(turn, evaluator, exc), "batch": batch}
        return results

    @staticmethod
    def _failed(turn: Turn, evaluator: Evaluator, exc: Exception) -> dict[str, Any]:
        log.warning(
            "evaluator failed",
            evaluator=evaluator.name,
            agent_id=str(turn.agent.id),
            error=turn.agent.redactor.redact(f"{type(exc).__name__}: {exc}"),
        )
        return {"success": False, "error": type(exc).__name__}
