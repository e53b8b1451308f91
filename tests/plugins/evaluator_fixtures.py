"""A second evaluator with a prompt segment, so a turn has two to pack into one batched call: TOPIC
names the message's topic. Each apply appends ``TOPIC <message id> <topic> <fallback?>`` to the
file named by the runtime process's FIXTURE_LOG variable."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Mapping
from pathlib import Path

from parley_runtime.sdk import ActionResult, Evaluator, EvaluatorPrompt, Plugin, TurnContext


def _append(path: Path, line: str) -> None:
    with path.open("a") as handle:
        handle.write(line)


async def _unused(ctx: TurnContext) -> ActionResult:
    raise AssertionError("TOPIC runs through the batcher in these tests")


async def _segment(ctx: TurnContext) -> EvaluatorPrompt:
    return EvaluatorPrompt(
        f"# Topic\nName the topic of this message in one or two words:\n{ctx.message.text}",
        ("topic: the topic, in one or two words",),
        {"topic": "unknown"},
    )


async def _apply(ctx: TurnContext, fields: Mapping[str, str], fell_back: bool) -> ActionResult:
    path = os.environ.get("FIXTURE_LOG")
    if path:
        line = f"TOPIC {ctx.message.id} {fields.get('topic', '')} {fell_back}\n"
        await asyncio.to_thread(_append, Path(path), line)
    return ActionResult(True, values={"topic": fields.get("topic", "")})


evaluator_plugin = Plugin(
    name="evaluator_fixtures",
    evaluators=(Evaluator("TOPIC", _unused, "names the topic", segment=_segment, apply=_apply),),
)
