"""think: an autonomous turn's plan is the answer of the agent's think section (asked by the model
gateway's prompt batcher when the scheduler drained the autonomy affinity), carried on the
runtime's own subject: no model call here, the post-model stages run on it."""

from __future__ import annotations

import json
from collections.abc import Mapping
from html import escape

from ...parser import parse_or_plain
from ..pipeline import Stage, Stop
from ..state import Turn

PLAN_METADATA = "parley_autonomy"  # the think section's answer, on the runtime's own subject only


def response_of(metadata: Mapping[str, str]) -> str:
    """The think answer of an autonomous message as the ``<response>`` contract the parser reads."""
    try:
        fields = json.loads(metadata.get(PLAN_METADATA, "") or "{}")
    except json.JSONDecodeError:
        fields = {}
    if not isinstance(fields, dict):
        fields = {}
    value = {k: str(fields.get(k) or "") for k in ("thought", "actions", "text", "params")}
    named = [a.strip() for a in value["actions"].split(",") if a.strip() and a.strip().upper() != "NONE"]
    # Nothing to do: a note alone is kept (REPLY to its own room), else the turn stays quiet.
    actions = ",".join(named) or ("REPLY" if value["text"].strip() else "IGNORE")
    params = f"<params>{value['params']}</params>" if value["params"].strip() else ""
    return (
        f"<response><thought>{escape(value['thought'], quote=False)}</thought>"
        f"<actions>{escape(actions, quote=False)}</actions>"
        f"{params}"
        f"<text>{escape(value['text'], quote=False)}</text></response>"
    )


class Think(Stage):
    name = "think"

    async def run(self, turn: Turn) -> Stop | None:
        if not turn.message.autonomous:  # only the runtime's own subject carries a think answer
            raise AssertionError("the think stage runs on autonomous turns only")
        raw = response_of(turn.message.proto.metadata)
        turn.raw_output = raw
        turn.trajectory["raw_output"] = raw[:16000]
        parsed = parse_or_plain(raw)
        turn.trajectory["parsed"] = {
            "actions": parsed.actions,
            "providers": parsed.providers,
            "thought": parsed.thought,
            "text": parsed.text,
        }
        turn.trajectory["autonomy"] = {"message_id": turn.message.proto.message_id}
        turn.ctx.parsed = parsed
        return None
