"""An inbound message: decoded and validated once, with the facts a turn derives from it (its
room, its sender, its world, its attachments) computed once."""

from __future__ import annotations

import re
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from functools import cached_property
from typing import Any

from google.protobuf.message import DecodeError

from parley.v1 import runtime_pb2
from parley_platform.consumer import Poison
from parley_platform.convert import uuid_or_none

from .. import ids
from ..agents.directory import AgentInfo
from ..names import ROLES, ROOM_TYPES
from ..sdk import MessageView

MAX_ID_CHARS = 256
MAX_METADATA_ENTRIES = 64
MAX_METADATA_VALUE = 4096
MAX_ATTACHMENTS = 32
SOURCE_PATTERN = re.compile(r"[A-Za-z0-9_-]{1,64}")
ID_FIELDS = (
    "message_id",
    "channel_id",
    "sender_id",
    "world_id",
    "in_reply_to",
    "sender_name",
    "sender_username",
)


class Origin(StrEnum):
    """Who started a turn. Decided by the subject a message came on, never by its payload."""

    USER = "user"  # a person, through a connector (<ns>.inbound.<agent>.<source>)
    CONTINUATION = "continuation"  # the runtime: a conversation continued after confirmations
    AUTONOMOUS = "autonomous"  # the runtime: the agent acting on its own


ORIGIN_METADATA = "parley_origin"  # on the runtime's own subject only: which of its origins


@dataclass(frozen=True)
class InboundSubject:
    agent: str
    source: str | None  # None on the runtime's own subject, <ns>.self.<agent>

    @property
    def from_runtime(self) -> bool:
        return self.source is None


def parse_subject(subject: str) -> InboundSubject:
    """``<ns>.inbound.<agent>.<source>`` or ``<ns>.self.<agent>`` (the INBOUND stream holds no other)."""
    tokens = subject.split(".")
    if len(tokens) == 3 and tokens[1] == "self":
        return InboundSubject(tokens[2], None)
    return InboundSubject(tokens[2] if len(tokens) > 2 else "", tokens[3] if len(tokens) > 3 else "")


def origin_of(subject: InboundSubject, proto: runtime_pb2.InboundMessage) -> Origin:
    if not subject.from_runtime:
        return Origin.USER
    claimed = proto.metadata.get(ORIGIN_METADATA, "")
    return Origin.AUTONOMOUS if claimed == Origin.AUTONOMOUS else Origin.CONTINUATION


def decode_inbound(
    data: bytes,
    subject_agent: str,
    agents: Mapping[str, AgentInfo],
    max_text_bytes: int,
    *,
    subject_source: str | None = None,
) -> tuple[runtime_pb2.InboundMessage, AgentInfo]:
    """Decode and validate an inbound payload; raises ``Poison`` with the reason. With
    ``subject_source`` (a connector's subject), the payload's source must be that one."""
    try:
        inbound = runtime_pb2.InboundMessage.FromString(data)
    except DecodeError as exc:
        raise Poison("payload is not a valid parley.v1.InboundMessage", label="undecodable") from exc
    if not inbound.agent_id:
        inbound.agent_id = subject_agent
    if inbound.agent_id != subject_agent:
        raise Poison(f"agent_id {inbound.agent_id[:64]!r} does not match the subject's agent", label="agent")
    agent = agents.get(inbound.agent_id)
    if agent is None:
        raise Poison(f"unknown agent {inbound.agent_id[:64]!r}", label="unknown_agent")
    if not inbound.source.strip():
        raise Poison("source is required (the connector's name)", label="no_source")
    if not SOURCE_PATTERN.fullmatch(inbound.source):
        raise Poison("source must be 1-64 letters, digits, '_' or '-'", label="bad_source")
    if subject_source is not None and inbound.source != subject_source:
        raise Poison(
            f"source {inbound.source!r} does not match the subject's source {subject_source[:64]!r}",
            label="source_mismatch",
        )
    if not inbound.message_id.strip():
        raise Poison("message_id is required (the connector's id for the message)", label="no_message_id")
    if not inbound.channel_id.strip():
        raise Poison("channel_id is required (the connector's id for the room)", label="no_channel")
    if not inbound.sender_id.strip():
        raise Poison("sender_id is required (the connector's id for the sender)", label="no_sender")
    size = len(inbound.text.encode())
    if size > max_text_bytes:
        raise Poison(f"text is {size} bytes, over the limit of {max_text_bytes}", label="too_large")
    for name in ID_FIELDS:
        if len(getattr(inbound, name)) > MAX_ID_CHARS:
            raise Poison(f"{name} is longer than {MAX_ID_CHARS} characters", label="too_large")
    if len(inbound.metadata) > MAX_METADATA_ENTRIES or any(
        len(k) > MAX_ID_CHARS or len(v) > MAX_METADATA_VALUE for k, v in inbound.metadata.items()
    ):
        raise Poison(
            f"metadata is limited to {MAX_METADATA_ENTRIES} entries, keys of {MAX_ID_CHARS} and values"
            f" of {MAX_METADATA_VALUE} characters",
            label="too_large",
        )
    if len(inbound.attachments) > MAX_ATTACHMENTS:
        raise Poison(f"at most {MAX_ATTACHMENTS} attachments", label="too_large")
    # PostgreSQL text cannot hold NUL: such a message could never be stored.
    for name, value in _strings(inbound):
        if "\x00" in value:
            raise Poison(f"{name} contains a NUL character", label="nul")
    role = inbound.metadata.get("sender_role", "")
    if role and role.upper() not in ROLES:
        raise Poison(f"metadata.sender_role must be one of {', '.join(sorted(ROLES))}", label="bad_role")
    return inbound, agent


def _strings(inbound: runtime_pb2.InboundMessage) -> list[tuple[str, str]]:
    found = [(f.name, getattr(inbound, f.name)) for f in inbound.DESCRIPTOR.fields if f.type == f.TYPE_STRING]
    found += [(f"metadata.{k}", f"{k}{v}") for k, v in inbound.metadata.items()]
    for index, a in enumerate(inbound.attachments):
        found += [(f"attachments[{index}].{f.name}", getattr(a, f.name)) for f in a.DESCRIPTOR.fields]
    return found


@dataclass(frozen=True)
class Inbound:
    """A validated inbound message of an agent and what follows from it."""

    proto: runtime_pb2.InboundMessage
    agent_id: uuid.UUID
    origin: Origin = Origin.USER  # decided by the subject it came on (origin_of), never the payload

    @property
    def autonomous(self) -> bool:
        return self.origin is Origin.AUTONOMOUS

    @property
    def from_runtime(self) -> bool:
        """A continuation or an autonomous turn: the runtime's own message, not a person's."""
        return self.origin is not Origin.USER

    @property
    def source(self) -> str:
        return self.proto.source

    @property
    def text(self) -> str:
        return self.proto.text

    @cached_property
    def turn_id(self) -> uuid.UUID:
        """The message memory's id, which is also its turn's id."""
        return ids.message_id(self.agent_id, self.proto.source, self.proto.message_id)

    @cached_property
    def room_id(self) -> uuid.UUID:
        return ids.room_id(self.agent_id, self.proto.source, self.proto.channel_id)

    @property
    def room_type(self) -> str:
        return ROOM_TYPES.get(self.proto.room_type, "GROUP")

    @property
    def from_self(self) -> bool:
        """A connector marks the agent's own messages by using the agent's id as the sender id."""
        return self.proto.sender_id == str(self.agent_id)

    @cached_property
    def sender_id(self) -> uuid.UUID:
        if self.from_self:
            return self.agent_id
        return ids.entity_id(self.agent_id, self.proto.source, self.proto.sender_id)

    @property
    def sender_name(self) -> str:
        return self.proto.sender_name or self.proto.sender_username or self.proto.sender_id

    @cached_property
    def world_id(self) -> uuid.UUID | None:
        if not self.proto.world_id:
            return None
        return ids.world_id(self.agent_id, self.proto.source, self.proto.world_id)

    @property
    def claimed_role(self) -> str | None:
        """The sender's role as the connector states it (checked against ROLES when decoded)."""
        return self.proto.metadata.get("sender_role", "").upper() or None

    @cached_property
    def attachments(self) -> list[dict[str, str]]:
        return [
            {"id": a.id, "url": a.url, "title": a.title, "contentType": a.content_type, "text": a.text}
            for a in self.proto.attachments
        ]

    def content(self) -> dict[str, Any]:
        """The message memory's content, as stored."""
        content: dict[str, Any] = {"text": self.proto.text, "source": self.proto.source}
        if self.attachments:
            content["attachments"] = self.attachments
        if self.proto.in_reply_to:
            content["inReplyTo"] = self.proto.in_reply_to
        if self.proto.metadata:
            content["metadata"] = dict(self.proto.metadata)
        return content

    def view(self) -> MessageView:
        """What handlers see of the message."""
        return MessageView(
            id=self.turn_id,
            text=self.proto.text,
            source=self.proto.source,
            channel_id=self.proto.channel_id,
            room_id=self.room_id,
            room_type=self.room_type,
            sender_id=self.sender_id,
            sender_name=self.sender_name,
            world_id=self.world_id,
            in_reply_to=self.proto.in_reply_to,
            attachments=self.attachments,
            metadata=dict(self.proto.metadata),
            autonomous=self.autonomous,
        )

    @property
    def reply_to_id(self) -> uuid.UUID | None:
        return uuid_or_none(self.proto.in_reply_to)
