"""A private action and an evaluator for the autonomy tests (tests/e2e/test_autonomy.py). Each
appends a line to the file named by the runtime process's FIXTURE_LOG variable: what ran, for
which message, in which process, and when, so the test can see every run and any overlap."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import Any

from parley_runtime.sdk import Action, ActionResult, Callback, Evaluator, Plugin, Tag, TurnContext


def _log(*words: object) -> None:
    path = os.environ.get("FIXTURE_LOG")
    if path:
        with Path(path).open("a") as handle:
            handle.write(" ".join(str(w) for w in words) + "\n")


async def _think_note(ctx: TurnContext, params: dict[str, Any], callback: Callback) -> ActionResult:
    _log("NOTE_START", ctx.message.id, os.getpid(), repr(time.time()))
    await asyncio.sleep(float(os.environ.get("FIXTURE_NOTE_SECONDS", "0")))
    _log("NOTE_END", ctx.message.id, os.getpid(), repr(time.time()))
    return ActionResult(True, text="noted")


async def _noticed(ctx: TurnContext) -> ActionResult:
    _log("EVALUATED", ctx.message.id, "autonomous" if ctx.is_autonomous else "user")
    return ActionResult(True)


autonomy_plugin = Plugin(
    name="autonomy_fixtures",
    actions=(
        Action(
            "THINK_NOTE",
            "write down what you are thinking (only on your own time)",
            _think_note,
            private=True,
            tags=frozenset({Tag.IDEMPOTENT}),
        ),
    ),
    evaluators=(Evaluator("NOTICED", _noticed, "records that a turn was evaluated"),),
)
