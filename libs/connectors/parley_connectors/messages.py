"""What a connector sends and receives, as plain dataclasses over the wire messages of
``parley.v1.runtime`` (InboundMessage, OutboundMessage, StreamChunk)."""

from __future__ import annotations

import datetime as dt
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Literal

from parley.v1 import runtime_pb2
from parley_platform.convert import set_now

from . import codes

RoomType = Literal["dm", "group", "thread", "api", "feed", "voice_dm"]
ROOM_TYPES: dict[str, int] = {
    "dm": runtime_pb2.ROOM_TYPE_DM,
    "group": runtime_pb2.ROOM_TYPE_GROUP,
    "thread": runtime_pb2.ROOM_TYPE_THREAD,
    "api": runtime_pb2.ROOM_TYPE_API,
    "feed": runtime_pb2.ROOM_TYPE_FEED,
    "voice_dm": runtime_pb2.ROOM_TYPE_VOICE_DM,
}


@dataclass(frozen=True)
class Attachment:
    id: str = ""
    url: str = ""
    title: str = ""
    content_type: str = ""
    text: str = ""  # extracted text (a transcript, a document's text), when the connector has it


@dataclass(frozen=True)
class Inbound:
    """A message from the platform. ``message_id`` is the platform's id for it: sending the same id
    twice (a retried webhook, a restarted connector) gives the agent one message, so one answer.

    ``channel_id`` names the room (a DM, a group, a thread: whatever gets its own conversation);
    ``mentions_agent`` says whether the agent was addressed in a group; ``in_reply_to`` is the
    platform id of the message this one answers; ``agent_id`` is needed only by a connector serving
    several agents."""

    message_id: str
    sender_id: str
    text: str
    channel_id: str = ""
    sender_name: str = ""
    sender_username: str = ""
    room_type: RoomType = "dm"
    mentions_agent: bool = False
    in_reply_to: str = ""
    attachments: list[Attachment] = field(default_factory=list)
    world_id: str = ""
    metadata: dict[str, str] = field(default_factory=dict)
    sent_at: dt.datetime | None = None
    agent_id: str = ""

    def to_proto(self, agent_id: str, source: str) -> runtime_pb2.InboundMessage:
        for name in ("message_id", "sender_id"):
            if not getattr(self, name):
                raise codes.INBOUND_INVALID(f"an inbound message needs a {name}")
        if self.room_type not in ROOM_TYPES:
            raise codes.INBOUND_INVALID(
                f"room_type {self.room_type!r} is not one of {', '.join(sorted(ROOM_TYPES))}"
            )
        message = runtime_pb2.InboundMessage(
            agent_id=agent_id,
            source=source,
            message_id=self.message_id,
            sender_id=self.sender_id,
            sender_name=self.sender_name or self.sender_id,
            sender_username=self.sender_username,
            channel_id=self.channel_id or f"{source}:{self.sender_id}",
            room_type=ROOM_TYPES[self.room_type],  # type: ignore[arg-type]
            world_id=self.world_id,
            text=self.text,
            in_reply_to=self.in_reply_to,
            mentions_agent=self.mentions_agent,
            attachments=[
                runtime_pb2.Attachment(
                    id=a.id, url=a.url, title=a.title, content_type=a.content_type, text=a.text
                )
                for a in self.attachments
            ],
            metadata=self.metadata,
        )
        if self.sent_at is not None:
            message.sent_at.FromDatetime(self.sent_at.astimezone(dt.UTC))
        else:
            set_now(message.sent_at)
        return message


async def _nothing() -> None:
    return None


@dataclass
class Reply:
    """A complete reply of the agent, delivered through the connector's durable consumer. Call
    ``ack()`` once it is handled (sent to the platform); unacknowledged, it comes again."""

    agent_id: str
    source: str
    response_id: str
    channel_id: str
    in_reply_to: str
    text: str
    actions: list[str]
    room_id: str
    created_at: dt.datetime | None = None
    deliveries: int = 1  # 2 or more: an earlier delivery was not acknowledged in time
    _ack: Callable[[], Awaitable[None]] = field(default=_nothing, repr=False, compare=False)
    _nak: Callable[[float], Awaitable[None]] = field(default=lambda _d: _nothing(), repr=False, compare=False)

    @classmethod
    def from_proto(cls, message: runtime_pb2.OutboundMessage, **delivery: object) -> Reply:
        return cls(
            agent_id=message.agent_id,
            source=message.source,
            response_id=message.response_id,
            channel_id=message.channel_id,
            in_reply_to=message.in_reply_to,
            text=message.text,
            actions=list(message.actions),
            room_id=message.room_id,
            created_at=message.created_at.ToDatetime(dt.UTC) if message.HasField("created_at") else None,
            **delivery,  # type: ignore[arg-type]
        )

    async def ack(self) -> None:
        """Handled: never deliver it again."""
        await self._ack()

    async def retry_later(self, delay: float = 5.0) -> None:
        """Not handled now (the platform is down): deliver it again after ``delay`` seconds."""
        await self._nak(delay)


@dataclass(frozen=True)
class Chunk:
    """A piece of a reply being generated (core NATS, best effort: the complete reply still comes
    as a ``Reply`` with the same ``response_id``). ``final`` marks the last one, with ``outcome``
    completed, superseded, cancelled or failed."""

    agent_id: str
    source: str
    turn_id: str
    response_id: str
    channel_id: str
    in_reply_to: str
    sequence: int
    delta: str
    final: bool
    outcome: str

    @classmethod
    def from_proto(cls, chunk: runtime_pb2.StreamChunk) -> Chunk:
        return cls(
            agent_id=chunk.agent_id,
            source=chunk.source,
            turn_id=chunk.turn_id,
            response_id=chunk.response_id,
            channel_id=chunk.channel_id,
            in_reply_to=chunk.in_reply_to,
            sequence=chunk.sequence,
            delta=chunk.delta,
            final=chunk.final,
            outcome=chunk.outcome,
        )
