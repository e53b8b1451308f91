"""The turn prompt, as segments: stable ones first so prefix caches can reuse them.

Stable: who the agent is, its instructions, the output format and the action
catalog. Unstable: everything the providers found for this message, and the
message itself. Invariant (checked here and again by the gateway):
``prompt == "".join(segment.content for segment in segments)``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .. import templating
from ..character import Character
from ..sdk import State

OUTPUT_FORMAT = """# Output format
Answer with exactly one XML block and nothing else:
<response>
  <thought>a short private thought</thought>
  <actions>REPLY</actions>
  <providers></providers>
  <text>what you say to the user</text>
</response>
<actions> lists the actions to take, comma separated, in order (REPLY to answer with <text>).
For an action with parameters, give them as
<params><ACTION_NAME><param_name>value</param_name></ACTION_NAME></params>.
<providers> may name extra context providers to consult before answering; leave it empty otherwise.
Use <actions>IGNORE</actions> with empty text when you should not answer.
"""

CURRENT_MESSAGE_HEADER = "# Current message\n"
STABLE_PROVIDERS = ("CHARACTER", "ACTIONS")


@dataclass(frozen=True)
class Segment:
    content: str
    stable: bool


@dataclass(frozen=True)
class Line:
    speaker: str
    text: str


MESSAGE_HANDLER_TEMPLATE = "messageHandlerTemplate"
# What a template may say that is the same on every turn of the agent: its stable prefix ends at the
# first placeholder that is not one of these (elizaOS's {{providers}}, {{recentMessages}}, ...).
STABLE_TEMPLATE_KEYS = frozenset({"actions", "actionNames", "actionExamples"})


def build_turn_prompt(character: Character, state: State, sender: str, text: str) -> list[Segment]:
    if character.templates.get(MESSAGE_HANDLER_TEMPLATE):
        return _template_prompt(character, state, sender, text)
    identity = [f"# Agent\nYou are {character.name}."]
    if character.system:
        identity.append(character.system.strip())
    stable = "\n".join(identity) + "\n\n"
    for name in STABLE_PROVIDERS:
        if state.texts.get(name):
            stable += state.texts[name].rstrip() + "\n\n"
    stable += OUTPUT_FORMAT
    segments = [Segment(stable, stable=True)]
    context = "".join(
        f"\n{body.rstrip()}\n" for name, body in state.texts.items() if name not in STABLE_PROVIDERS and body
    )
    if context:
        segments.append(Segment(context, stable=False))
    segments.append(Segment(f"\n{CURRENT_MESSAGE_HEADER}{sender}: {text.strip()}\n", stable=False))
    return segments


def _template_prompt(character: Character, state: State, sender: str, text: str) -> list[Segment]:
    """The character's messageHandlerTemplate as the planner prompt, elizaOS's placeholders filled."""
    template = character.templates[MESSAGE_HANDLER_TEMPLATE]
    stable_keys = STABLE_TEMPLATE_KEYS | templating.character_values(character).keys() | templating.AGENT_KEYS
    head, tail = templating.split_at_first(
        template, lambda key: key not in stable_keys and not templating.PERSON.fullmatch(key)
    )
    values = {
        "actions": state.texts.get("ACTIONS", ""),
        **{k: str(v) for k, v in state.values.items() if isinstance(v, str)},
        "providers": "\n\n".join(body.rstrip() for body in state.texts.values() if body),
        "recentMessages": state.texts.get("RECENT_MESSAGES", ""),
        "knowledge": state.texts.get("KNOWLEDGE", ""),
        "attachments": state.texts.get("ATTACHMENTS", ""),
        "entities": state.texts.get("ENTITIES", ""),
        "senderName": sender,
        **{name: body for name, body in state.texts.items()},
    }
    identity = f"# Agent\nYou are {character.name}.\n" + (
        f"{character.system.strip()}\n" if character.system else ""
    )
    stable = identity + "\n" + templating.render(head, character, values)
    rest = templating.render(tail, character, values)
    if "<response>" not in template:
        rest += "\n" + OUTPUT_FORMAT
    segments = [Segment(stable, stable=True)]
    if rest:
        segments.append(Segment(rest, stable=False))
    segments.append(Segment(f"\n{CURRENT_MESSAGE_HEADER}{sender}: {text.strip()}\n", stable=False))
    return segments


def join_segments(segments: Sequence[Segment]) -> str:
    return "".join(s.content for s in segments)
