"""An example plugin: the agent keeps notes for the people it talks to.

It imports only from ``parley_runtime.sdk`` and shows each part of a plugin:
- an action with JSON-schema parameters and sub-actions (``NOTE`` with ``op: add | list``),
- a provider that adds the room's notes to what the model sees,
- an evaluator that runs after each reply,
- a non-idempotent action (no ``Tag.IDEMPOTENT``): the runtime writes an effect claim
  before it runs, so a retried turn never adds the same note twice.
"""

from __future__ import annotations

from typing import Any

from parley_runtime.sdk import (
    Action,
    ActionResult,
    Callback,
    Content,
    Evaluator,
    Parameter,
    Plugin,
    Provider,
    ProviderResult,
    TurnContext,
    dispatch_subaction,
)


async def _add(ctx: TurnContext, params: dict[str, Any], callback: Callback) -> ActionResult:
    text = str(params.get("text") or "").strip()
    if not text:
        return ActionResult(False, error="a note needs text")
    await ctx.services.remember(
        "facts", f"Note from {ctx.message.sender_name}: {text}", metadata={"note": True}
    )
    await callback(Content(text=f"Noted: {text}", actions=("NOTE",)))
    return ActionResult(True, text=text, values={"op": "add"})


async def _list(ctx: TurnContext, params: dict[str, Any], callback: Callback) -> ActionResult:
    hits = await ctx.services.search_memories(str(params.get("text") or "note"), kind="facts", limit=10)
    notes = [h.text for h in hits if h.text.startswith("Note from")]
    await callback(Content(text="\n".join(notes) or "No notes yet.", actions=("NOTE",)))
    return ActionResult(True, values={"op": "list", "count": len(notes)})


async def _note(ctx: TurnContext, params: dict[str, Any], callback: Callback) -> ActionResult:
    _, handler = dispatch_subaction(params, {"add": _add, "list": _list})
    return await handler(ctx, params, callback)


async def _notes_in_room(ctx: TurnContext) -> ProviderResult:
    hits = await ctx.services.search_memories(ctx.message.text or "note", kind="facts", limit=3)
    notes = [h.text for h in hits if h.text.startswith("Note from")]
    return ProviderResult("# Notes\n" + "\n".join(notes) if notes else "", values={"notes": len(notes)})


async def _count_turns(ctx: TurnContext) -> ActionResult:
    return ActionResult(True, values={"noted": any(r.values.get("op") == "add" for r in ctx.results)})


notes_plugin = Plugin(
    name="notes",
    description="Keeps notes for the people the agent talks to.",
    actions=(
        Action(
            "NOTE",
            "Add a note (op=add, text=...) or list the notes (op=list).",
            _note,
            similes=("TAKE_NOTE", "REMEMBER_THIS"),
            parameters=(
                Parameter(
                    "op",
                    "add or list",
                    required=True,
                    schema={"type": "string", "enum": ["add", "list"]},
                    aliases=("operation",),
                ),
                Parameter(
                    "text",
                    "the note (for add) or what to look for (for list)",
                    schema={"type": "string", "maxLength": 2000},
                ),
            ),
        ),
    ),
    providers=(
        Provider("NOTES", _notes_in_room, "notes about this conversation", position=15, dynamic=True),
    ),
    evaluators=(Evaluator("NOTE_TRACKER", _count_turns, "records whether a note was taken"),),
)
