"""The runtime's stored records as typed values: ``store.py`` builds them from rows (``from_row``),
and nothing else reads a row."""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

Row = Mapping[str, Any]


@dataclass(frozen=True)
class NewMessage:
    """An inbound message to ingest: what the ingest statement stores and takes the lease with."""

    agent_id: uuid.UUID
    world_id: uuid.UUID | None
    world_external_id: str | None
    source: str
    entity_id: uuid.UUID
    entity_names: list[str]
    entity_metadata: dict[str, Any]
    room_id: uuid.UUID
    channel_id: str
    room_type: str
    stream_epoch: int
    stream_seq: int
    memory_id: uuid.UUID
    content: dict[str, Any]
    external_id: str
    history: int  # how many recent messages of the room to return
    sender_role: str | None
    reply_to_id: uuid.UUID | None
    origin: str = "user"  # who started the turn: user, continuation or autonomous


@dataclass(frozen=True)
class StoredMemory:
    """A memory as ``RuntimeStore.remember`` writes it (its room, sender and source are the call's)."""

    id: uuid.UUID
    kind: str
    text: str
    embedding: Sequence[float] | None
    metadata: Mapping[str, Any]


@dataclass(frozen=True)
class RecentMessage:
    entity_id: uuid.UUID
    name: str | None
    text: str
    created_at: datetime | str

    @classmethod
    def from_json(cls, value: Row) -> RecentMessage:
        return cls(
            uuid.UUID(str(value["entity_id"])),
            value.get("name"),
            value.get("text") or "",
            value["created_at"],
        )


@dataclass(frozen=True)
class RoomParticipant:
    entity_id: uuid.UUID
    names: tuple[str, ...]
    role: str
    state: str | None

    @classmethod
    def from_json(cls, value: Row) -> RoomParticipant:
        return cls(
            uuid.UUID(str(value["entity_id"])),
            tuple(value.get("names") or ()),
            value["role"],
            value.get("user_state"),
        )


@dataclass(frozen=True)
class MuteState:
    """The agent's state in a room or world: FOLLOWED, or MUTED (until a time, or for good)."""

    state: str | None
    until: datetime | None = None

    @classmethod
    def from_json(cls, value: Row | None) -> MuteState | None:
        if not value:
            return None
        until = value.get("until")
        if until is not None and not isinstance(until, datetime):
            until = datetime.fromisoformat(str(until))
        return cls(value.get("state"), until)

    def active(self, now: datetime) -> tuple[bool, bool]:
        """(muted now, a timed mute that has expired)."""
        if self.state != "MUTED":
            return False, False
        if self.until is None:
            return True, False
        return self.until > now, self.until <= now


@dataclass(frozen=True)
class Ingested:
    """What the ingest statement found and did for one inbound message."""

    state: str | None  # the turn's state after ingest; None when it had already finished
    previous_state: str | None  # None for a message seen for the first time
    previous_response_id: uuid.UUID | None
    attempts: int
    lease_token: int | None  # None: this copy did not get the room's lease
    history: list[RecentMessage]  # the room's recent messages, oldest first
    participants: list[RoomParticipant]
    room_state: MuteState | None
    world_metadata: dict[str, Any] | None
    sender_role: str | None
    replies_to_agent: bool
    sender_role_source: str | None = None  # connector or operator (SetParticipantRole)
    # Read by the same statement for a turn that runs (None otherwise): the agent's custom-action
    # revision (0 before the first), and whether it has facts and documents to search.
    custom_action_revision: int | None = None
    has_facts: bool | None = None
    has_documents: bool | None = None
    # The room's latest replies before this message, saved in the last minutes (for a turn that
    # runs): they go on the outbound stream before this turn's own (Outbox.publish_turn, turn/ports.py).
    earlier_replies: list[StoredReply] = field(default_factory=list)

    @classmethod
    def from_row(cls, row: Row) -> Ingested:
        running = row["state"] == "running"
        return cls(
            state=row["state"],
            previous_state=row["previous_state"],
            previous_response_id=row["previous_response_id"],
            attempts=row["attempts"] or 0,
            lease_token=row["lease_token"],
            history=[RecentMessage.from_json(h) for h in row["history"] or []],
            participants=[RoomParticipant.from_json(p) for p in row["participants"] or []],
            room_state=MuteState.from_json(row["agent_room_state"]),
            world_metadata=row["world_metadata"],
            sender_role=row["sender_role"],
            replies_to_agent=bool(row["replies_to_agent"]),
            sender_role_source=row.get("sender_role_source"),
            custom_action_revision=int(row["custom_action_revision"] or 0) if running else None,
            has_facts=row["has_facts"] if running else None,
            has_documents=row["has_documents"] if running else None,
            earlier_replies=[
                StoredReply(uuid.UUID(r["id"]), r["content"]) for r in row.get("earlier_replies") or []
            ],
        )

    @property
    def world_mute(self) -> MuteState | None:
        world = self.world_metadata or {}
        if world.get("agent_mute_state") != "MUTED":
            return None
        return MuteState.from_json({"state": "MUTED", "until": world.get("agent_mute_until")})


@dataclass(frozen=True)
class StoredReply:
    id: uuid.UUID
    content: dict[str, Any]


@dataclass(frozen=True)
class Effect:
    """The claim written before a non-idempotent action ran, and its result once recorded."""

    result: dict[str, Any] | None


@dataclass(frozen=True)
class MemoryMatch:
    id: uuid.UUID
    kind: str
    text: str
    similarity: float
    created_at: datetime | None

    @classmethod
    def from_row(cls, row: Row) -> MemoryMatch:
        return cls(row["id"], row["kind"], row["text"] or "", float(row["similarity"]), row["created_at"])


@dataclass(frozen=True)
class Memory:
    id: uuid.UUID
    kind: str
    room_id: uuid.UUID | None
    entity_id: uuid.UUID | None
    content: dict[str, Any]
    source: str | None
    in_reply_to: uuid.UUID | None
    created_at: datetime

    @classmethod
    def from_row(cls, row: Row) -> Memory:
        return cls(
            row["id"],
            row["kind"],
            row["room_id"],
            row["entity_id"],
            row["content"] or {},
            row["source"],
            row["in_reply_to"],
            row["created_at"],
        )


@dataclass(frozen=True)
class TurnRecord:
    id: uuid.UUID
    room_id: uuid.UUID
    state: str
    reason: str | None
    attempts: int
    response_id: uuid.UUID | None
    error: str | None
    stream_seq: int
    received_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    trajectory: dict[str, Any] | None = None
    origin: str = "user"

    @classmethod
    def from_row(cls, row: Row) -> TurnRecord:
        return cls(
            row["id"],
            row["room_id"],
            row["state"],
            row.get("reason"),
            row["attempts"],
            row["response_id"],
            row["error"],
            row["stream_seq"],
            row["received_at"],
            row.get("started_at"),
            row.get("finished_at"),
            row.get("trajectory"),
            row.get("origin") or "user",
        )


@dataclass(frozen=True)
class StoredAgent:
    id: uuid.UUID
    name: str
    character: dict[str, Any]
    enabled: bool
    created_at: datetime | None = None

    @classmethod
    def from_row(cls, row: Row) -> StoredAgent:
        return cls(row["id"], row["name"], row["character"], row["enabled"], row.get("created_at"))


@dataclass(frozen=True)
class Invocation:
    """What a confirmed action needs of the message that proposed it, to run later on any replica
    exactly as that message's turn would have run it."""

    source: str
    message_id: str
    channel_id: str
    sender_id: str
    sender_name: str
    sender_username: str
    room_type: str
    world_id: str
    text: str
    in_reply_to: str = ""
    metadata: dict[str, str] = field(default_factory=dict)
    attachments: list[dict[str, str]] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "messageId": self.message_id,
            "channelId": self.channel_id,
            "senderId": self.sender_id,
            "senderName": self.sender_name,
            "senderUsername": self.sender_username,
            "roomType": self.room_type,
            "worldId": self.world_id,
            "text": self.text,
            "inReplyTo": self.in_reply_to,
            "metadata": dict(self.metadata),
            "attachments": list(self.attachments),
        }

    @classmethod
    def from_json(cls, value: Row) -> Invocation:
        return cls(
            source=value["source"],
            message_id=value["messageId"],
            channel_id=value["channelId"],
            sender_id=value["senderId"],
            sender_name=value.get("senderName", ""),
            sender_username=value.get("senderUsername", ""),
            room_type=value.get("roomType", "GROUP"),
            world_id=value.get("worldId", ""),
            text=value.get("text", ""),
            in_reply_to=value.get("inReplyTo", ""),
            metadata=dict(value.get("metadata") or {}),
            attachments=list(value.get("attachments") or []),
        )


@dataclass(frozen=True)
class ToolCall:
    """An action a turn proposed that waits for a person's confirmation (``runtime.tool_call``)."""

    id: str  # the tool call id authz knows it by: <turn id>:<action index>
    agent_id: uuid.UUID
    turn_id: uuid.UUID
    action_index: int  # its position in the turn's plan
    call_index: int  # its position among the calls the prompt asks about
    room_id: uuid.UUID
    message_id: uuid.UUID  # the prompt's reply id, which authz groups the message's calls by
    action: str
    params: dict[str, Any]
    requester_id: uuid.UUID
    role: str
    invocation: Invocation
    created_at: datetime | None = None  # set by the database when the proposal is stored
