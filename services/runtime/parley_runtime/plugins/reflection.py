"""REFLECTION: after a reply, the facts and relationships worth remembering about the people in
the conversation."""

from __future__ import annotations

import json

from ..agent_settings import setting_bool
from ..sdk import ActionResult, Evaluator, TurnContext
from .arguments import json_object

REFLECTION_PROMPT = """# Reflection
You are {name}. Read the conversation and list new, lasting facts worth remembering about the people in it
(preferences, names, plans), and relationships between them. Skip small talk and anything already known.

Conversation:
{conversation}

Answer with one JSON object only:
{{"facts": ["..."], "relationships": [{{"source": "...", "target": "...", "kind": "..."}}]}}
"""


REFLECTION_MIN_WORDS = 4


async def _should_reflect(ctx: TurnContext) -> bool:
    """Reflect on messages that can carry a fact (not greetings or one-word answers), unless the
    character turns it off with REFLECTION: false; each reflection is a model call."""
    enabled = setting_bool(ctx.services.get_setting("REFLECTION"))
    words = len(ctx.message.text.split())
    from_agent = ctx.message.sender_id == ctx.agent_id  # its own words: a continuation, a thought
    return enabled is not False and words >= REFLECTION_MIN_WORDS and not ctx.is_autonomous and not from_agent


async def _reflect(ctx: TurnContext) -> ActionResult:
    lines = [f"{line.name}: {line.text}" for line in ctx.history[-8:]]
    lines.append(f"{ctx.message.sender_name}: {ctx.message.text}")
    answer = await ctx.services.generate(
        REFLECTION_PROMPT.format(name=ctx.character.name, conversation="\n".join(lines)),
        small=True,
        structured=True,
    )
    found = json_object(answer) or {}
    facts = [f.strip() for f in found.get("facts", []) if isinstance(f, str) and f.strip()][:10]
    relationships = [r for r in found.get("relationships", []) if isinstance(r, dict)][:10]
    for fact in facts:
        await ctx.services.remember("facts", fact, metadata={"source": "reflection"})
    for rel in relationships:
        text = f"{rel.get('source', '?')} {rel.get('kind', 'knows')} {rel.get('target', '?')}"
        await ctx.services.remember(
            "facts", text, metadata={"source": "reflection", "relationship": json.dumps(rel)}
        )
    return ActionResult(True, values={"facts": len(facts), "relationships": len(relationships)})


reflection = Evaluator("REFLECTION", _reflect, "extracts facts and relationships", _should_reflect)
