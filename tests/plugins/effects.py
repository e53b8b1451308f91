"""``effects``: a test plugin whose one action has a side effect the runtime cannot undo.

``RECORD_EFFECT`` is not tagged ``effect:idempotent``, so the runtime writes an effect claim
before it runs. Every run of its handler appends one row to ``public.effect_log`` through a
connection of its own (DSN from the agent setting ``EFFECT_LOG_DSN``), committed before the
handler returns: the log is the ground truth of how many times the effect happened, whatever
the runtime's own tables say. A test counts rows per turn id to prove that no turn's effect
ran twice, even with runtimes killed mid-turn.

A message whose text contains ``HOLD_MARKER`` holds its run inside the effect: the row is
written (the effect happened) and the handler does not return (its result is not recorded) for
``EFFECT_HOLD_SECONDS``, so that a test sees the row appear and kills the replica holding it, in
exactly the window an effect claim exists for (tests/e2e/test_runtime_scale.py).

Load it with ``plugins: [plugins.effects:effects_plugin]`` in a character and
``PYTHONPATH=<repo>/tests`` in the runtime's environment.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

import psycopg

from parley_runtime.sdk import Action, ActionResult, Callback, Parameter, Plugin, Tag, TurnContext

DSN_SETTING = "EFFECT_LOG_DSN"
# Milliseconds the effect takes, half before the row is written and half after: a wider window
# for a crash between the claim and the effect, and between the effect and its recorded result.
DELAY_SETTING = "EFFECT_DELAY_MS"
# In a message's text: hold the run after the effect, until the test kills this replica.
HOLD_MARKER = "and hold the effect"
# How long a held run waits at most (a test that never kills it sees the effect "ran once").
HOLD_SETTING = "EFFECT_HOLD_SECONDS"

# Created by the test that uses the plugin (before any runtime starts), not by the handler:
# concurrent CREATE TABLE IF NOT EXISTS can collide on the catalog.
EFFECT_LOG_DDL = """
CREATE TABLE IF NOT EXISTS public.effect_log (
    turn_id  uuid NOT NULL,
    pid      integer NOT NULL,
    at       timestamptz NOT NULL DEFAULT clock_timestamp()
)
"""


async def _record_effect(ctx: TurnContext, params: dict[str, Any], callback: Callback) -> ActionResult:
    dsn = ctx.services.get_setting(DSN_SETTING)
    if not isinstance(dsn, str) or not dsn.strip():
        return ActionResult(False, error=f"{DSN_SETTING} is not set: nothing was recorded")
    delay = float(str(ctx.services.get_setting(DELAY_SETTING) or 0)) / 1000
    await asyncio.sleep(delay / 2)
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        await conn.execute(
            "INSERT INTO public.effect_log (turn_id, pid) VALUES (%s, %s)", (ctx.message.id, os.getpid())
        )
    if HOLD_MARKER in ctx.message.text:
        await asyncio.sleep(float(str(ctx.services.get_setting(HOLD_SETTING) or 60)))
    await asyncio.sleep(delay / 2)
    return ActionResult(True, text="effect recorded", values={"pid": os.getpid()})


effects_plugin = Plugin(
    name="effects",
    description="A non-idempotent test action that records each of its runs outside the runtime.",
    actions=(
        Action(
            "RECORD_EFFECT",
            "Record that the user asked for something to be recorded (an effect that must happen once).",
            _record_effect,
            similes=("RECORD",),
            capabilities=frozenset({"test"}),
        ),
        # The same effect, behind a person's confirmation (tests/e2e/test_confirmations.py).
        Action(
            "LAUNCH_ROCKET",
            "Launch the rocket: it cannot be undone, so a person confirms it first.",
            _record_effect,
            tags=frozenset({Tag.CONFIRM}),
            capabilities=frozenset({"test"}),
            parameters=(Parameter("target", "where to", schema={"type": "string"}),),
        ),
    ),
)
