"""The built-in ``basic_capabilities`` plugin: replying, staying quiet, following and
muting rooms, the providers that give the model its context, and REFLECTION."""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta
from typing import Any

from parley_platform.errors import ParleyError

from .. import templating
from ..documents.knowledge import knowledge
from ..sdk import (
    Action,
    ActionResult,
    Callback,
    Content,
    Parameter,
    Plugin,
    Provider,
    ProviderResult,
    Tag,
    TurnContext,
)
from .reflection import reflection

IDEMPOTENT = frozenset({Tag.IDEMPOTENT})
EXAMPLE_CONVERSATIONS = 5
EXAMPLE_POSTS = 5


async def _reply(ctx: TurnContext, params: dict[str, Any], callback: Callback) -> ActionResult:
    text = str(params.get("text") or (ctx.parsed.text if ctx.parsed else "")).strip()
    if not text:
        return ActionResult(False, error="REPLY needs text to say")
    await callback(Content(text=text, actions=("REPLY",), thought=ctx.parsed.thought if ctx.parsed else ""))
    return ActionResult(True, text=text)


async def _nothing(ctx: TurnContext, params: dict[str, Any], callback: Callback) -> ActionResult:
    return ActionResult(True)


SOURCE_TARGET = re.compile(r"(?P<source>[A-Za-z0-9_-]{1,64}):(?P<channel>.+)")


async def _send_message(ctx: TurnContext, params: dict[str, Any], callback: Callback) -> ActionResult:
    """A channel of the turn's connector; on an autonomous turn (whose own room no connector
    serves) ``<source>:<channel>``, a room of any connector of the agent."""
    target = str(params["target"]).strip()
    text = str(params["text"]).strip()
    source = ""
    found = SOURCE_TARGET.fullmatch(target) if ctx.is_autonomous else None
    if found is not None:
        source, target = found["source"], found["channel"].strip()
    elif ctx.is_autonomous:
        return ActionResult(
            False, error="SEND_MESSAGE from an autonomous turn needs target <source>:<channel>"
        )
    await callback(Content(text=text, actions=("SEND_MESSAGE",), target_channel=target, target_source=source))
    return ActionResult(True, text=text, values={"target": target, "source": source or ctx.message.source})


APPROVE = frozenset({"yes", "y", "approve", "approved", "confirm", "ok", "okay", "go", "proceed", "sure"})
DENY = frozenset({"no", "n", "deny", "denied", "cancel", "reject", "stop", "abort"})
DECIDERS = frozenset({"OWNER", "ADMIN"})


async def _choice(ctx: TurnContext, params: dict[str, Any], callback: Callback) -> ActionResult:
    """Answer the room's pending confirmations: the sender's own, or any as OWNER/ADMIN.

    It only records the decision; an approved action runs where every approval runs (the
    runtime's consumer of authz's claim events), once."""
    option = str(params.get("option", "")).strip().lower()
    if option not in APPROVE | DENY:
        return ActionResult(False, error="CHOICE needs option yes or no")
    approve = option in APPROVE
    wanted = str(params.get("id") or "").strip()
    pending = [
        call
        for call in await ctx.services.pending_confirmations()
        if (not wanted or call.tool_call_id == wanted)
        and (call.requester_id == str(ctx.message.sender_id) or ctx.role in DECIDERS)
    ]
    if not pending:
        await callback(Content(text="Nothing here is waiting for your confirmation.", actions=("CHOICE",)))
        return ActionResult(False, error="NO_PENDING_CONFIRMATION")
    decided: dict[str, str] = {}
    for call in pending:
        try:
            decided[call.tool_call_id] = await ctx.services.decide_confirmation(
                call.tool_call_id, approve=approve, reason="" if approve else f"declined: {option}"
            )
        except ParleyError as exc:
            decided[call.tool_call_id] = exc.code.lower()
    verb = "Approved" if approve else "Cancelled"
    names = ", ".join(call.action for call in pending)
    waiting = [call.action for call in await ctx.services.pending_confirmations()]
    if waiting:
        # Once nothing waits, the agent's follow-up with the results is the answer; a reply here
        # would race it (the newer message in the room wins the turn).
        text = f"{verb}: {names}. Still waiting for: {', '.join(waiting)}."
        await callback(Content(text=text, actions=("CHOICE",)))
    return ActionResult(True, text=f"{verb}: {names}", values={"decisions": decided, "approve": approve})


def _room_state(state: str | None, label: str) -> Any:
    async def handler(ctx: TurnContext, params: dict[str, Any], callback: Callback) -> ActionResult:
        until = None
        minutes = params.get("minutes")
        if state == "MUTED" and isinstance(minutes, (int, float)) and minutes > 0:
            until = datetime.now(UTC) + timedelta(minutes=float(minutes))
        await ctx.services.set_room_state(state, mute_until=until)
        return ActionResult(
            True, text=label, values={"room_state": state, "mute_until": until.isoformat() if until else None}
        )

    return handler


async def _character(ctx: TurnContext) -> ProviderResult:
    c = ctx.character
    parts = [f"# About {c.name}"]
    if c.bio:
        parts.append(" ".join(c.bio))
    if c.lore:
        parts.append("Lore: " + " ".join(c.lore))
    if c.topics:
        parts.append("Topics: " + ", ".join(c.topics))
    if c.adjectives:
        parts.append("Adjectives: " + ", ".join(c.adjectives))
    style = [*c.style.get("all", []), *c.style.get("chat", [])]
    if style:
        parts.append("Style: " + "; ".join(style))
    for example in templating.example_lines(c, EXAMPLE_CONVERSATIONS):
        parts.append("Example:\n" + example)
    if c.post_examples:
        parts.append("Posts in your voice:\n" + "\n".join(f"- {p}" for p in c.post_examples[:EXAMPLE_POSTS]))
    return ProviderResult(templating.names("\n".join(parts), c.name), values={"agentName": c.name})


async def _recent_messages(ctx: TurnContext) -> ProviderResult:
    if not ctx.history:
        return ProviderResult()
    lines = "".join(f"{line.name}: {' '.join(line.text.split())}\n" for line in ctx.history)
    return ProviderResult("# Conversation so far\n" + lines, data={"count": len(ctx.history)})


async def _actions(ctx: TurnContext) -> ProviderResult:
    catalog = templating.names(await ctx.services.action_catalog(), ctx.character.name)
    names = [line[2:].split(":", 1)[0] for line in catalog.splitlines() if line.startswith("- ")]
    return ProviderResult(
        "# Available actions\n" + catalog,
        values={"actionNames": "Possible response actions: " + ", ".join(names)},
    )


async def _entities(ctx: TurnContext) -> ProviderResult:
    if not ctx.participants:
        return ProviderResult()
    lines = [f"- {', '.join(p.names) or p.entity_id} ({p.role.lower()})" for p in ctx.participants]
    return ProviderResult(
        "# People in this room\n" + "\n".join(lines),
        data={"entities": [p.entity_id for p in ctx.participants]},
    )


async def _time(ctx: TurnContext) -> ProviderResult:
    now = datetime.now(UTC)
    return ProviderResult(
        f"# Time\nThe current date and time is {now:%Y-%m-%d %H:%M} UTC.", values={"now": now.isoformat()}
    )


async def _facts(ctx: TurnContext) -> ProviderResult:
    if not ctx.message.text.strip():
        return ProviderResult()
    hits = await ctx.services.search_memories(ctx.message.text, kind="facts", limit=5)
    if not hits:
        return ProviderResult()
    return ProviderResult(
        "# Things you know\n" + "\n".join(f"- {h.text}" for h in hits), data={"facts": [h.id for h in hits]}
    )


async def _attachments(ctx: TurnContext) -> ProviderResult:
    if not ctx.message.attachments:
        return ProviderResult()
    lines = []
    for a in ctx.message.attachments:
        line = f"- {a.get('title') or a.get('id') or 'attachment'} ({a.get('contentType') or 'unknown type'})"
        if a.get("text"):
            line += f": {a['text'][:2000]}"
        lines.append(line)
    return ProviderResult("# Attachments\n" + "\n".join(lines))


basic_capabilities = Plugin(
    name="basic_capabilities",
    description="Replying, staying quiet, following and muting rooms, context providers and reflection.",
    actions=(
        Action(
            "REPLY",
            "Answer in the current conversation with the text of the response.",
            _reply,
            similes=("RESPOND", "GREET", "ANSWER"),
            tags=IDEMPOTENT,
        ),
        Action(
            "IGNORE",
            "Do not answer: the message is not for you, or the conversation is over.",
            _nothing,
            similes=("STOP_TALKING",),
            tags=IDEMPOTENT,
        ),
        Action(
            "NONE",
            "Do nothing more than answer (if there is text).",
            _nothing,
            similes=("NO_ACTION",),
            tags=IDEMPOTENT,
        ),
        Action(
            "SEND_MESSAGE",
            "Send a message to another channel of the same connector.",
            _send_message,
            similes=("MESSAGE", "DM"),
            tags=IDEMPOTENT,
            examples=(
                "{{user1}}: tell the ops channel the deploy is done\n"
                "{{agentName}}: <actions>SEND_MESSAGE</actions><params><SEND_MESSAGE>"
                "<target>ops</target><text>The deploy is done.</text></SEND_MESSAGE></params>",
            ),
            parameters=(
                Parameter("target", "the channel id to send to", required=True, aliases=("channel", "to")),
                Parameter("text", "what to send", required=True, aliases=("message",)),
            ),
        ),
        Action(
            "FOLLOW_ROOM",
            "Take part in every conversation of this room, mention or not.",
            _room_state("FOLLOWED", "following the room"),
            tags=IDEMPOTENT,
        ),
        Action(
            "UNFOLLOW_ROOM",
            "Stop following this room: answer only when addressed.",
            _room_state(None, "no longer following the room"),
            tags=IDEMPOTENT,
        ),
        Action(
            "MUTE_ROOM",
            "Stay silent in this room, even when mentioned, until unmuted.",
            _room_state("MUTED", "room muted"),
            tags=IDEMPOTENT,
            parameters=(
                Parameter(
                    "minutes",
                    "mute for this many minutes (default: until unmuted)",
                    schema={"type": "number", "exclusiveMinimum": 0},
                ),
            ),
        ),
        Action(
            "UNMUTE_ROOM", "Speak in this room again.", _room_state(None, "room unmuted"), tags=IDEMPOTENT
        ),
        Action(
            "CHOICE",
            "Answer a pending confirmation: option yes to let the waiting action run, no to cancel it.",
            _choice,
            similes=("CONFIRM", "APPROVE", "SELECT_OPTION"),
            # Deciding twice is safe: authz records one decision and answers the repeat with it.
            tags=IDEMPOTENT,
            parameters=(
                Parameter("option", "yes or no", required=True, aliases=("answer", "decision", "choice")),
                Parameter("id", "the approval id, when several are waiting", aliases=("tool_call_id",)),
            ),
        ),
    ),
    providers=(
        Provider("CHARACTER", _character, "who the agent is", position=-100),
        Provider("ACTIONS", _actions, "the actions the agent may take", position=-50),
        Provider("TIME", _time, "the current time", position=-10),
        Provider("ENTITIES", _entities, "the people in the room", position=0),
        Provider("FACTS", _facts, "what the agent remembers that relates to the message", position=10),
        Provider(
            "KNOWLEDGE", knowledge, "documents the sender may read that relate to the message", position=15
        ),
        Provider("ATTACHMENTS", _attachments, "files attached to the message", position=20),
        Provider("RECENT_MESSAGES", _recent_messages, "the room's recent messages", position=100),
    ),
    evaluators=(reflection,),
)
