"""after-reply: the message and reply embeddings and the evaluators, in the background once the
reply is delivered; they never delay or fail a turn. The evaluators with prompt segments share one
batched model call (turn/evaluation.py)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Coroutine
from typing import Any

from parley_platform.errors import ParleyError
from parley_platform.logging import get_logger

from ... import ids
from ...store import RuntimeStore
from ..embeddings import MessageEmbeddings
from ..evaluation import Evaluations
from ..pipeline import Stage, Stop
from ..ports import Model
from ..services import TurnServices
from ..state import Turn

log = get_logger(__name__)


class Background:
    """The background work of the turns of this replica, awaited (within a timeout) at shutdown."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[None]] = set()

    def spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def __len__(self) -> int:
        return len(self._tasks)

    async def drain(self, timeout: float) -> None:
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=timeout)


class AfterReply(Stage):
    name = "after_reply"
    closing = True

    def __init__(
        self,
        store: RuntimeStore,
        model: Model,
        background: Background,
        *,
        embed_messages: bool,
        trajectory_logging: bool,
        embedding_window: float = 0.0,
        evaluator_timeout: float = 60.0,
    ) -> None:
        self.store = store
        # The turns' embeddings, computed and stored in batches.
        self.embeddings = MessageEmbeddings(store, model.embed, window=embedding_window)
        self.model = model
        self.background = background
        self.embed_messages = embed_messages
        self.trajectory_logging = trajectory_logging
        self.evaluator_timeout = evaluator_timeout

    async def run(self, turn: Turn) -> Stop | None:
        if turn.outcome in ("replied", "ignored"):
            self.background.spawn(self.after(turn))
        return None

    async def after(self, turn: Turn) -> None:
        if self.embed_messages:
            await self._embed(turn)
        # No evaluator reflects on the words of a sender the gate did not admit (answered with a
        # pairing challenge): they reach no text model. Their message is embedded like every stored
        # one (the backfill would embed it otherwise).
        if turn.agent.catalog.evaluators and not turn.gated:
            await self._evaluate(turn)

    async def _embed(self, turn: Turn) -> None:
        memories = [(turn.id, turn.message.text)] + [
            (ids.response_id(turn.id, i), r.text) for i, r in enumerate(turn.replies)
        ]
        services = turn.ctx.services
        searched = services.embedded(turn.message.text) if isinstance(services, TurnServices) else None
        try:
            await self.embeddings.add(turn.agent.id, memories, {turn.id: searched} if searched else None)
        except ParleyError as exc:
            log.warning(
                "message embeddings failed", agent_id=str(turn.agent.id), turn_id=str(turn.id), error=str(exc)
            )

    async def _evaluate(self, turn: Turn) -> None:
        model = self.model
        evaluations = Evaluations(model.batchers, timeout=self.evaluator_timeout, window=model.batch_window)
        results = await evaluations.run(turn)
        agent = turn.agent
        if self.trajectory_logging and results:
            with contextlib.suppress(ParleyError):
                await self.store.add_trajectory(
                    agent.id, turn.id, agent.redactor.redact_obj({"evaluators": results})
                )
