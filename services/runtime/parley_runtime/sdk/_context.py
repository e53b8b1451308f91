"""What actions, providers and evaluators see of a turn: ``TurnContext``, and through it the
runtime services a handler may ask for (``RuntimeServices``)."""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Protocol

from ..character import Character
from ..parser import ParsedResponse


@dataclass(frozen=True)
class MessageView:
    id: uuid.UUID  # the message memory's id
    text: str
    source: str
    channel_id: str
    room_id: uuid.UUID
    room_type: str
    sender_id: uuid.UUID  # the sender's entity id
    sender_name: str
    world_id: uuid.UUID | None = None
    in_reply_to: str = ""
    attachments: Sequence[Mapping[str, str]] = ()
    metadata: Mapping[str, str] = field(default_factory=dict)
    # Started by the runtime itself, not by a person: decided by the runtime, never by a field a
    # connector sends.
    autonomous: bool = False


@dataclass(frozen=True)
class HistoryLine:
    entity_id: str
    name: str
    text: str
    created_at: str


@dataclass(frozen=True)
class Participant:
    entity_id: str
    names: Sequence[str]
    role: str
    state: str | None


@dataclass(frozen=True)
class PendingCall:
    """An action of this room waiting for a human decision (see confirmations.py)."""

    tool_call_id: str
    action: str
    summary: str
    requester_id: str  # the entity whose message proposed it


@dataclass(frozen=True)
class KnowledgeHit:
    """A fragment of a document the message's sender may read (see documents.py)."""

    document_id: str
    title: str
    position: int
    text: str
    similarity: float


@dataclass(frozen=True)
class NewMemory:
    """A memory to store with ``RuntimeServices.remember_all``."""

    kind: str
    text: str
    metadata: Mapping[str, Any] | None = None


@dataclass(frozen=True)
class MemoryHit:
    id: str
    kind: str
    text: str
    similarity: float
    created_at: datetime | None = None


class RuntimeServices(Protocol):
    """What a handler may ask of the runtime. Everything is scoped to the turn's agent."""

    async def set_room_state(self, state: str | None, *, mute_until: datetime | None = None) -> None: ...

    async def search_memories(self, text: str, *, kind: str = "facts", limit: int = 5) -> list[MemoryHit]: ...

    async def remember(
        self, kind: str, text: str, *, metadata: Mapping[str, Any] | None = None
    ) -> uuid.UUID: ...

    async def remember_all(self, memories: Sequence[NewMemory]) -> list[uuid.UUID]:
        """Several memories of the turn's room at once (one embedding call, one statement); their
        ids, in order. Each is stored once: the same kind and text in the room is the same memory."""
        ...

    async def relate(
        self,
        source_entity_id: str,
        target_entity_id: str,
        *,
        tags: Sequence[str],
        metadata: Mapping[str, Any] | None = None,
    ) -> uuid.UUID:
        """Record a relationship between two entities of the agent (tags merged with what was known)."""
        ...

    async def generate(self, prompt: str, *, small: bool = False, structured: bool = False) -> str:
        """Ask the model; ``structured`` for JSON/object answers (the OBJECT_* model types)."""
        ...

    def get_setting(self, key: str) -> object | None: ...

    async def action_catalog(self) -> str: ...

    async def search_documents(self, text: str, *, limit: int = 5) -> list[KnowledgeHit]:
        """Fragments of the documents the message's sender may read, most similar first."""
        ...

    async def pending_confirmations(self) -> list[PendingCall]:
        """The room's actions waiting for a decision."""
        ...

    async def decide_confirmation(self, tool_call_id: str, *, approve: bool, reason: str = "") -> str:
        """Approve or deny one as the message's sender; the answer says what happened."""
        ...


@dataclass
class State:
    """Provider output merged: text per provider (in position order), values and data."""

    texts: dict[str, str] = field(default_factory=dict)
    values: dict[str, Any] = field(default_factory=dict)
    data: dict[str, Any] = field(default_factory=dict)

    def text(self) -> str:
        return "\n\n".join(t for t in self.texts.values() if t)


@dataclass
class TurnContext:
    agent_id: uuid.UUID
    character: Character
    message: MessageView
    role: str
    history: Sequence[HistoryLine]
    participants: Sequence[Participant]
    services: RuntimeServices
    state: State = field(default_factory=State)
    parsed: ParsedResponse | None = None
    results: list[Any] = field(default_factory=list)  # ActionResults of earlier actions in this turn
    # The room's turn counter at this turn: 1 for the room's first, and one more for each message
    # that took the room since (a redelivered copy counts again). 0 when not known (a context
    # rebuilt to run a confirmed action).
    room_turn: int = 0

    @property
    def is_autonomous(self) -> bool:
        return self.message.autonomous
