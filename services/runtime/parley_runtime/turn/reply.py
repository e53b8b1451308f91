"""What the agent says: one ``Reply`` type, stored as a memory and published to connectors."""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from google.protobuf.timestamp_pb2 import Timestamp

from parley.v1 import runtime_pb2
from parley_platform.convert import set_now

from ..sdk import Content


@dataclass(frozen=True)
class Reply:
    """A reply to an inbound message. Its id is derived from the message's (see ``ids``), so a
    retried turn publishes the same id and JetStream keeps one copy."""

    id: uuid.UUID
    text: str
    source: str  # the connector
    channel_id: str  # the room's channel; SEND_MESSAGE's target channel when there is one
    in_reply_to: str  # the connector's id of the message answered
    actions: tuple[str, ...] = ()
    thought: str = ""
    target_channel: str = ""
    # What actions attached (files, images, links): {id, url, title, content_type, text}.
    attachments: tuple[Mapping[str, str], ...] = ()

    @classmethod
    def of(cls, id: uuid.UUID, content: Content, *, source: str, channel_id: str, in_reply_to: str) -> Reply:
        return cls(
            id=id,
            text=content.text,
            source=content.target_source or source,
            channel_id=content.target_channel or channel_id,
            in_reply_to=in_reply_to,
            actions=tuple(content.actions),
            thought=content.thought,
            target_channel=content.target_channel,
            attachments=tuple(_attachment(a) for a in content.attachments),
        )

    def redacted(self, redact: Callable[[str], str]) -> Reply:
        """Without the agent's secrets: what is stored and published never holds them."""
        return dataclasses.replace(
            self,
            text=redact(self.text),
            thought=redact(self.thought),
            attachments=tuple({k: redact(v) for k, v in a.items()} for a in self.attachments),
        )

    def content(self) -> dict[str, Any]:
        """The memory's content, as stored (camelCase keys, as elizaOS stores them)."""
        stored: dict[str, Any] = {
            "text": self.text,
            "actions": list(self.actions),
            "thought": self.thought,
            "source": self.source,
            "inReplyTo": self.in_reply_to,
        }
        if self.target_channel:
            stored["targetChannel"] = self.target_channel
        if self.attachments:
            stored["attachments"] = [dict(a) for a in self.attachments]
        return stored

    @classmethod
    def from_content(cls, id: uuid.UUID, stored: Mapping[str, Any], *, channel_id: str) -> Reply:
        """A stored reply, read back to publish it again (``channel_id``: the room's channel)."""
        target = str(stored.get("targetChannel") or "")
        return cls(
            id=id,
            text=str(stored.get("text") or ""),
            source=str(stored.get("source") or ""),
            channel_id=target or channel_id,
            in_reply_to=str(stored.get("inReplyTo") or ""),
            actions=tuple(str(a) for a in stored.get("actions") or ()),
            thought=str(stored.get("thought") or ""),
            target_channel=target,
            attachments=tuple(
                _attachment(a) for a in stored.get("attachments") or () if isinstance(a, Mapping)
            ),
        )

    def outbound(self, agent_id: uuid.UUID, room_id: uuid.UUID) -> runtime_pb2.OutboundMessage:
        created = Timestamp()
        set_now(created)
        return runtime_pb2.OutboundMessage(
            agent_id=str(agent_id),
            source=self.source,
            response_id=str(self.id),
            channel_id=self.channel_id,
            in_reply_to=self.in_reply_to,
            text=self.text,
            actions=self.actions,
            thought=self.thought,
            room_id=str(room_id),
            created_at=created,
            attachments=[runtime_pb2.Attachment(**a) for a in self.attachments],
        )


ATTACHMENT_FIELDS = ("id", "url", "title", "content_type", "text")


def _attachment(value: Mapping[str, Any]) -> dict[str, str]:
    """An attachment as the wire carries it: the known fields as text (``contentType`` too)."""
    found = {**value, "content_type": value.get("content_type") or value.get("contentType") or ""}
    return {f: str(found.get(f) or "") for f in ATTACHMENT_FIELDS}
