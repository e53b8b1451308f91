"""The turn prompt, as segments: stable ones first so prefix caches can reuse them.

Invariant (checked here and again by the gateway):
``prompt == "".join(segment.content for segment in segments)``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .character import Character

OUTPUT_FORMAT = """# Output format
Answer with exactly one XML block and nothing else:
<response>
  <thought>a short private thought</thought>
  <actions>REPLY</actions>
  <text>what you say to the user</text>
</response>
Use <actions>IGNORE</actions> with empty text when you should not answer.
"""

CURRENT_MESSAGE_HEADER = "# Current message\n"


@dataclass(frozen=True)
class Segment:
    content: str
    stable: bool


@dataclass(frozen=True)
class Line:
    speaker: str
    text: str


def _one_line(text: str) -> str:
    return " ".join(text.split())


def build_turn_prompt(character: Character, history: Sequence[Line], current: Line) -> list[Segment]:
    identity = [f"# Agent\nYou are {character.name}."]
    if character.system:
        identity.append(character.system.strip())
    if character.bio:
        identity.append(" ".join(b.strip() for b in character.bio))
    if character.style.get("chat") or character.style.get("all"):
        identity.append(
            "Style: " + "; ".join([*character.style.get("all", []), *character.style.get("chat", [])])
        )
    segments = [Segment("\n".join(identity) + "\n\n" + OUTPUT_FORMAT, stable=True)]
    if history:
        lines = "".join(f"{line.speaker}: {_one_line(line.text)}\n" for line in history)
        segments.append(Segment("\n# Conversation so far\n" + lines, stable=False))
    segments.append(
        Segment(f"\n{CURRENT_MESSAGE_HEADER}{current.speaker}: {current.text.strip()}\n", stable=False)
    )
    return segments


def join_segments(segments: Sequence[Segment]) -> str:
    return "".join(s.content for s in segments)
