"""REFLECTION: after a reply, what is worth remembering: lasting facts about the people in the
conversation (``facts`` memories), relationships between them (the agent's relationship rows,
with tags), and a short reflection on the conversation (a ``reflections`` memory).

It runs on a room's every ``REFLECTION_INTERVAL``-th turn (a setting; default 4), over the room's
recent messages, as elizaOS's does once more than a quarter of its 32-message conversation window
is new (two messages a turn). With an interval of 1 it runs after every message of four words or
more instead: one that cannot carry a fact is passed over. The history it reads reaches back
``max(8, 2 × interval)`` messages (as far as ``PARLEY_RUNTIME_RECENT_MESSAGES`` keeps), so each
reflection reads the turns since the one before.

Its question is a prompt segment: one section of the turn's batched evaluator call (see
turn/evaluation.py). A character's ``templates.reflectionTemplate`` replaces the question.
Without the batcher the same question is asked on its own."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from .. import templating
from ..agent_settings import setting_bool, setting_int
from ..sdk import ActionResult, Evaluator, EvaluatorPrompt, NewMemory, TurnContext
from .arguments import json_object

REFLECTION_PROMPT = """# Reflection
You are {{agentName}}. Read the conversation and note what is worth remembering: new, lasting facts
about the people in it (preferences, names, plans), relationships between them, and a short
reflection on how the conversation went. Skip small talk and anything already known.

Conversation:
{{recentMessages}}
"""
FIELDS = (
    "facts: the new facts as a JSON array of strings, [] when there are none",
    'relationships: relationships between the people, as a JSON array of {"source": name, '
    '"target": name, "tags": [words such as friend, colleague, sibling]}, [] when there are none',
    "reflection: one or two sentences on what you noticed in this conversation",
)
FALLBACK = {"facts": "[]", "relationships": "[]", "reflection": ""}
JSON_ANSWER = """
Answer with one JSON object only:
{"facts": ["..."], "relationships": [{"source": "...", "target": "...", "tags": ["..."]}],
 "reflection": "..."}
"""
TEMPLATE = "reflectionTemplate"
REFLECTION_MIN_WORDS = 4
REFLECTION_INTERVAL = 4  # turns of a room between reflections
MAX_ITEMS = 10


def _interval(ctx: TurnContext) -> int:
    """The character's ``REFLECTION_INTERVAL`` (a whole number of turns, 1 or more), else 4."""
    interval = setting_int(ctx.services.get_setting("REFLECTION_INTERVAL"))
    return interval if interval is not None and interval >= 1 else REFLECTION_INTERVAL


async def _should_reflect(ctx: TurnContext) -> bool:
    """On the room's every interval-th turn (every turn: only on a message that can carry a fact,
    not a greeting or a one-word answer); never on the agent's own words or an autonomous turn,
    nor when the character turns it off with REFLECTION: false."""
    if setting_bool(ctx.services.get_setting("REFLECTION")) is False:
        return False
    if ctx.is_autonomous or ctx.message.sender_id == ctx.agent_id:  # its own words: a continuation
        return False
    interval = _interval(ctx)
    if interval == 1:
        return len(ctx.message.text.split()) >= REFLECTION_MIN_WORDS
    return ctx.room_turn > 0 and ctx.room_turn % interval == 0


def _question(ctx: TurnContext) -> str:
    lines = [f"{line.name}: {line.text}" for line in ctx.history[-max(8, 2 * _interval(ctx)) :]]
    lines.append(f"{ctx.message.sender_name}: {ctx.message.text}")
    template = ctx.character.templates.get(TEMPLATE) or REFLECTION_PROMPT
    values = {"recentMessages": "\n".join(lines), "senderName": ctx.message.sender_name}
    return templating.render(template, ctx.character, values)


async def _segment(ctx: TurnContext) -> EvaluatorPrompt:
    return EvaluatorPrompt(_question(ctx), FIELDS, FALLBACK)


def _json_list(text: str) -> list[Any]:
    try:
        value = json.loads(text or "[]")
    except json.JSONDecodeError:
        if text.lstrip().startswith("["):
            return _complete_items(text)
        # A model that wrote one item per line instead of JSON still said something.
        return [line.strip("-• ").strip() for line in text.splitlines() if line.strip("-• ").strip()]
    return value if isinstance(value, list) else []


def _complete_items(text: str) -> list[Any]:
    """The whole items of a JSON array cut short (a model that ran out of tokens): the last one,
    cut in the middle, is dropped rather than kept as a fact that ends mid-word."""
    decoder = json.JSONDecoder()
    items: list[Any] = []
    at = text.index("[") + 1
    while True:
        while at < len(text) and text[at] in " \t\r\n,":
            at += 1
        if at >= len(text) or text[at] == "]":
            return items
        try:
            item, at = decoder.raw_decode(text, at)
        except json.JSONDecodeError:
            return items
        items.append(item)


def _entities(ctx: TurnContext) -> dict[str, str]:
    """The people of the room by each of their names (lower case), and the sender by theirs."""
    found = {name.strip().lower(): p.entity_id for p in ctx.participants for name in p.names if name.strip()}
    found[ctx.message.sender_name.strip().lower()] = str(ctx.message.sender_id)
    return found


async def _apply(ctx: TurnContext, fields: Mapping[str, str], fell_back: bool) -> ActionResult:
    facts = [f.strip() for f in _json_list(fields.get("facts", "")) if isinstance(f, str) and f.strip()]
    relationships = [r for r in _json_list(fields.get("relationships", "")) if isinstance(r, dict)]
    reflection = str(fields.get("reflection") or "").strip()
    found = [NewMemory("facts", fact, {"source": "reflection"}) for fact in facts[:MAX_ITEMS]]
    people = _entities(ctx)
    related, unknown = 0, 0
    for rel in relationships[:MAX_ITEMS]:
        said = rel.get("tags")
        raw: list[Any] = said if isinstance(said, list) else [rel.get("kind") or "knows"]
        tags = sorted({str(t).strip().lower()[:40] for t in raw if str(t).strip()})
        source = people.get(str(rel.get("source", "")).strip().lower())
        target = people.get(str(rel.get("target", "")).strip().lower())
        if source and target and source != target:
            await ctx.services.relate(source, target, tags=tags, metadata={"source": "reflection"})
            related += 1
        else:  # someone who is not an entity of this agent: kept as a fact, as said
            unknown += 1
            text = f"{rel.get('source', '?')} is {', '.join(tags)} of {rel.get('target', '?')}"
            found.append(NewMemory("facts", text, {"source": "reflection", "relationship": json.dumps(rel)}))
    if reflection:
        found.append(NewMemory("reflections", reflection[:2000], {"source": "reflection"}))
    # One embedding call and one statement for everything it found.
    await ctx.services.remember_all(found)
    return ActionResult(
        True,
        values={
            "facts": len(facts[:MAX_ITEMS]),
            "relationships": related,
            "relationships_as_facts": unknown,
            "reflection": bool(reflection),
            "fallback": fell_back,
        },
    )


async def _reflect(ctx: TurnContext) -> ActionResult:
    """The same question on its own, when the batcher is not used."""
    answer = await ctx.services.generate(_question(ctx) + JSON_ANSWER, small=True, structured=True)
    found = json_object(answer) or {}
    fields = {
        "facts": json.dumps(found.get("facts", [])),
        "relationships": json.dumps(found.get("relationships", [])),
        "reflection": str(found.get("reflection") or ""),
    }
    return await _apply(ctx, fields, False)


reflection = Evaluator(
    "REFLECTION",
    _reflect,
    "remembers facts, relationships between people and a reflection on the conversation",
    _should_reflect,
    segment=_segment,
    apply=_apply,
)
