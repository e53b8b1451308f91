"""The turn prompt, as segments: stable ones first so prefix caches can reuse them.

Stable: who the agent is, its instructions, the output format and the action
catalog. Unstable: everything the providers found for this message, and the
message itself. Invariant (checked here and again by the gateway):
``prompt == "".join(segment.content for segment in segments)``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

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


def build_turn_prompt(character: Character, state: State, sender: str, text: str) -> list[Segment]:
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


def join_segments(segments: Sequence[Segment]) -> str:
    return "".join(s.content for s in segments)
