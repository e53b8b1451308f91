"""compose: the providers' context for the prompt, gathered concurrently within one total timeout;
a provider that fails or is late is left out (and counted), never fatal."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from parley_platform.logging import get_logger

from ...sdk import Provider, State, TurnContext
from ...secrets import Redactor
from ..pipeline import Stage, Stop
from ..state import Turn, TurnMetrics

log = get_logger(__name__)


async def gather(
    providers: Sequence[Provider],
    ctx: TurnContext,
    *,
    timeout: float,
    metrics: TurnMetrics,
    redactor: Redactor,
) -> State:
    state = State()
    if not providers:
        return state
    tasks = {p.name: asyncio.ensure_future(p.get(ctx)) for p in providers}
    _, pending = await asyncio.wait(tasks.values(), timeout=timeout)
    for task in pending:
        task.cancel()
    for provider in providers:
        task = tasks[provider.name]
        if task in pending or task.cancelled() or task.exception() is not None:
            metrics.providers_failed.labels(provider.name).inc()
            error = "timed out" if task in pending else repr(task.exception())
            log.warning(
                "provider failed",
                provider=provider.name,
                agent_id=str(ctx.agent_id),
                error=redactor.redact(error),
            )
            continue
        result = task.result()
        if result.text:
            state.texts[provider.name] = result.text
        state.values.update(result.values)
        state.data[provider.name] = dict(result.data)
    return state


class Compose(Stage):
    name = "compose"

    def __init__(self, metrics: TurnMetrics, *, timeout: float) -> None:
        self.metrics = metrics
        self.timeout = timeout

    async def run(self, turn: Turn) -> Stop | None:
        providers = [p for p in turn.agent.catalog.providers if not p.dynamic]
        turn.ctx.state = await gather(
            providers, turn.ctx, timeout=self.timeout, metrics=self.metrics, redactor=turn.agent.redactor
        )
        return None
