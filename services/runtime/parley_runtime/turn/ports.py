"""The turn's ports: typed clients of what lies outside the runtime's process, passed in.

``Model`` (the model gateway), ``Outbox`` (replies to connectors), ``Inbox`` (messages the
runtime gives itself), ``Events`` (the EVENTS stream), and the clients of authz
(``AuthzClient``, generated) and pairing (``PairingGate``).
Stages, runtime services and the confirmation flow take ``Ports``; none reaches into another.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass

from parley.v1 import model_pb2, runtime_pb2
from parley.v1.authz_nats import AuthzClient
from parley.v1.model_nats import ModelGatewayClient
from parley_clients.batcher import BatcherClient
from parley_clients.pairing import PairingGate
from parley_platform.bus import Bus
from parley_platform.errors import ParleyError

from ..agents.directory import AgentInfo
from .inbound import ORIGIN_METADATA, Origin
from .prompt import Segment, join_segments
from .reply import Reply
from .streaming import ChunkPublisher

MODEL_TYPES = {
    (False, False): model_pb2.MODEL_TYPE_TEXT_LARGE,
    (False, True): model_pb2.MODEL_TYPE_TEXT_SMALL,
    (True, False): model_pb2.MODEL_TYPE_OBJECT_LARGE,
    (True, True): model_pb2.MODEL_TYPE_OBJECT_SMALL,
}


class Model:
    """Text and embeddings from the model gateway, and (``batchers``) its prompt batcher's client
    per agent, through which the evaluators of a turn share one call; None: each on its own."""

    def __init__(
        self,
        gateway: ModelGatewayClient,
        batchers: Callable[[uuid.UUID], BatcherClient] | None = None,
        *,
        batch_window: float = 0.0,
    ) -> None:
        self.gateway = gateway
        self.batchers = batchers
        self.batch_window = batch_window  # seconds a turn's evaluators wait to share a drain

    async def generate(
        self,
        agent_id: uuid.UUID,
        segments: Sequence[Segment],
        *,
        small: bool = False,
        structured: bool = False,
    ) -> str:
        request = model_pb2.GenerateRequest(
            agent_id=str(agent_id),
            model_type=MODEL_TYPES[(structured, small)],
            prompt=join_segments(segments),
            segments=[model_pb2.PromptSegment(content=s.content, stable=s.stable) for s in segments],
        )
        return (await self.gateway.Generate(request)).text

    def stream(
        self, agent_id: uuid.UUID, segments: Sequence[Segment]
    ) -> AsyncIterator[model_pb2.GenerateChunk]:
        """The reply's generation as the model writes it; the last chunk is ``done`` with the whole
        response. Closing the iterator cancels the generation (the gateway closes its provider's
        stream)."""
        request = model_pb2.GenerateRequest(
            agent_id=str(agent_id),
            model_type=MODEL_TYPES[(False, False)],
            prompt=join_segments(segments),
            segments=[model_pb2.PromptSegment(content=s.content, stable=s.stable) for s in segments],
        )
        return self.gateway.GenerateStream(request)

    async def embed(self, texts: Sequence[str], agent_id: uuid.UUID) -> list[list[float]]:
        reply = await self.gateway.Embed(model_pb2.EmbedRequest(agent_id=str(agent_id), texts=texts))
        return [list(e.values) for e in reply.embeddings]


class Outbox:
    """Replies to the connectors, durably on PARLEY_OUTBOUND under the reply's id (deduplicated)."""

    def __init__(self, bus: Bus) -> None:
        self.bus = bus

    async def publish(self, agent_id: uuid.UUID, room_id: uuid.UUID, reply: Reply) -> None:
        await self.bus.publish(
            self.bus.subjects.outbound(str(agent_id), reply.source),
            reply.outbound(agent_id, room_id).SerializeToString(),
            msg_id=str(reply.id),
        )


EventListener = Callable[[AgentInfo, str, uuid.UUID, uuid.UUID, Mapping[str, str]], None]


class Events:
    """The runtime's events, on ``<ns>.events.<agent>.<TYPE>``; attributes are redacted. Each is
    also handed to the listeners in this process (the plugins' event handlers), which must not
    block: they run their handlers in the background."""

    def __init__(self, bus: Bus) -> None:
        self.bus = bus
        self.listeners: list[EventListener] = []

    async def emit(
        self, agent: AgentInfo, event_type: str, turn: uuid.UUID, room: uuid.UUID, **attributes: str
    ) -> None:
        """Published without waiting for JetStream's ack: events must never slow a turn."""
        event = runtime_pb2.Event(
            id=str(uuid.uuid4()),
            type=event_type,
            agent_id=str(agent.id),
            room_id=str(room),
            turn_id=str(turn),
            attributes=agent.redactor.redact_obj(attributes),
        )
        event.at.GetCurrentTime()
        with contextlib.suppress(ParleyError):
            await self.bus.publish_core(
                self.bus.subjects.events(str(agent.id), event_type), event.SerializeToString()
            )
        for listener in self.listeners:
            listener(agent, event_type, turn, room, event.attributes)


class Inbox:
    """Messages the runtime gives itself (a conversation's continuation, an autonomous thought), on
    the INBOUND stream under the runtime's own subject, which no connector may publish to;
    deduplicated by their id."""

    def __init__(self, bus: Bus) -> None:
        self.bus = bus

    async def publish(self, message: runtime_pb2.InboundMessage, origin: Origin) -> None:
        message.metadata[ORIGIN_METADATA] = origin.value
        await self.bus.publish(
            self.bus.subjects.self_inbound(message.agent_id),
            message.SerializeToString(),
            msg_id=f"{message.source}:{message.message_id}",
        )


@dataclass(frozen=True)
class Ports:
    model: Model
    outbox: Outbox
    inbox: Inbox
    events: Events
    authz: AuthzClient
    pairing: PairingGate
    chunks: ChunkPublisher
