"""What autonomy asks and how its answers become turns: the settings, the think section, and the
autonomous message (pure, no I/O)."""

from __future__ import annotations

import hashlib
import json
import re
import uuid
from collections.abc import Mapping
from dataclasses import dataclass

from parley.v1 import model_pb2, runtime_pb2
from parley_clients.batcher import Field

from .. import templating
from ..character import Character
from ..plugins.catalog import describe
from ..sdk import Action
from ..turn.stages.think import PLAN_METADATA

INTERVAL_DEFAULT_MS = 30_000
INTERVAL_MIN_MS = 5_000
INTERVAL_MAX_MS = 600_000
MODEL_SIZES = ("small", "large")
DEFAULT_MODEL_SIZE = "large"
ENABLED_SETTINGS = ("AUTONOMY_ENABLED", "enableAutonomy")

# The agent's own room for what it does on its own: one per agent, no connector serves it.
SOURCE = "autonomy"
CHANNEL = "autonomy"
AFFINITY = "autonomy"
OWNER = "autonomy"  # every replica registers and disposes the agent's think section as this owner
MAX_METADATA = 4096
_CANONICAL = re.compile(r"[1-9][0-9]{0,17}")

FIELDS = (
    Field("thought", "what you think now, in one or two sentences"),
    Field("actions", "the actions to take now, comma-separated names, or NONE"),
    Field("text", "a note to keep in your own room (leave empty for none)", optional=True),
    Field(
        "params",
        "the parameters of the actions as XML, <ACTION><name>value</name></ACTION> per action",
        optional=True,
    ),
)


def interval_ms(value: object | None) -> int:
    """AUTONOMY_INTERVAL_MS: a canonical positive decimal integer, clamped to 5,000-600,000;
    anything else (unset, blank, malformed) is 30,000."""
    text = value if isinstance(value, str) else str(value) if isinstance(value, int) else ""
    if isinstance(value, bool) or not _CANONICAL.fullmatch(text):
        return INTERVAL_DEFAULT_MS
    return min(max(int(text), INTERVAL_MIN_MS), INTERVAL_MAX_MS)


def model_size(value: object | None) -> str:
    """AUTONOMY_MODEL_SIZE: exactly small or large; anything else is large."""
    return value if isinstance(value, str) and value in MODEL_SIZES else DEFAULT_MODEL_SIZE


@dataclass(frozen=True)
class Plan:
    """How an agent thinks right now: its switch and the section that asks for it."""

    enabled: bool
    decided_by: str  # operator or character
    generation: int
    interval_ms: int
    model_size: str
    prompt: str

    @property
    def model_type(self) -> int:
        return (
            model_pb2.MODEL_TYPE_TEXT_SMALL if self.model_size == "small" else model_pb2.MODEL_TYPE_TEXT_LARGE
        )

    @property
    def section_id(self) -> str:
        """Named by everything it asks with, so every replica names the same section and a change
        (a new generation, interval, model or prompt) is a new section."""
        digest = hashlib.sha256(
            json.dumps([self.generation, self.interval_ms, self.model_size, self.prompt]).encode()
        ).hexdigest()[:16]
        return f"autonomy-{self.generation}-{digest}"


def think_prompt(character: Character, actions: Mapping[str, Action]) -> str:
    """The think section's request: who the agent is, what it may do, what to answer."""
    lines = [f"You are {character.name}."]
    if character.system.strip():
        lines.append(character.system.strip())
    if character.bio:
        lines.append(" ".join(b.strip() for b in character.bio if b.strip()))
    lines += [
        "Nobody has written to you: this is your own time to think. Decide whether to act now.",
        "Actions you may take (SEND_MESSAGE reaches a person: target <source>:<channel>):",
        templating.names(describe(list(actions.values())), character.name),
    ]
    return "\n".join(line for line in lines if line)


def message_of(
    agent_id: uuid.UUID, agent_name: str, result: model_pb2.SectionResult
) -> runtime_pb2.InboundMessage:
    """The autonomous message of one think result: the agent's own thought, in its autonomy room,
    carrying the answer it acts on. Its id names the section and the drain, so every replica that
    received the result publishes the same message and JetStream keeps one."""
    fields = {k: result.fields.get(k, "") for k in ("thought", "actions", "text", "params")}
    message = runtime_pb2.InboundMessage(
        agent_id=str(agent_id),
        source=SOURCE,
        message_id=f"{result.section_id}-{result.drain_seq}",
        channel_id=CHANNEL,
        room_type=runtime_pb2.ROOM_TYPE_SELF,
        sender_id=str(agent_id),
        sender_name=agent_name,
        text=fields["thought"][:2000] or "(thinking)",
    )
    message.metadata[PLAN_METADATA] = _bounded(fields)
    return message


def _bounded(fields: dict[str, str]) -> str:
    """The answer as JSON within a metadata value's limit: the longest field is cut until it fits."""
    fields = dict(fields)
    encoded = json.dumps(fields, ensure_ascii=False)
    while len(encoded) > MAX_METADATA:
        longest = max(fields, key=lambda k: len(fields[k]))
        fields[longest] = fields[longest][: max(0, len(fields[longest]) - (len(encoded) - MAX_METADATA) - 16)]
        encoded = json.dumps(fields, ensure_ascii=False)
    return encoded
