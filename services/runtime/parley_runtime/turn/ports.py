"""The turn's ports: typed clients of what lies outside the runtime's process, passed in.

``Model`` (the model gateway), ``Outbox`` (replies to connectors), ``Inbox`` (messages the
runtime gives itself), ``Events`` (the EVENTS stream), and the clients of authz
(``AuthzClient``, generated) and pairing (``PairingGate``).
Stages, runtime services and the confirmation flow take ``Ports``; none reaches into another.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass

from parley.v1 import model_pb2, runtime_pb2
from parley.v1.authz_nats import AuthzClient
from parley.v1.model_nats import ModelGatewayClient
from parley_clients.batcher import BatcherClient
from parley_clients.pairing import PairingGate
from parley_platform.bus import Bus
from parley_platform.convert import set_now
from parley_platform.errors import ParleyError

from ..agents.directory import AgentInfo
from .embeddings import EmbedCalls
from .inbound import ORIGIN_METADATA, Origin
from .prompt import Segment
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
        self._embed_calls = EmbedCalls(self._embed)

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
            segments=[model_pb2.PromptSegment(content=s.content, stable=s.stable) for s in segments],
        )
        return self.gateway.GenerateStream(request)

    async def embed(self, texts: Sequence[str], agent_id: uuid.UUID) -> list[list[float]]:
        """The texts' embeddings; an agent's calls made while another is under way share the next
        ``Embed`` (``EmbedCalls``)."""
        return await self._embed_calls(texts, agent_id)

    async def _embed(self, texts: Sequence[str], agent_id: uuid.UUID) -> list[list[float]]:
        reply = await self.gateway.Embed(model_pb2.EmbedRequest(agent_id=str(agent_id), texts=texts))
        return [list(e.values) for e in reply.embeddings]


class Outbox:
    """Replies to the connectors, durably on PARLEY_OUTBOUND under the reply's id (deduplicated).

    A turn's replies go out in its room's message order (``publish_turn``): before them, the room's
    earlier replies, which the ingest read from the room's row (the latest saved before this
    message took the room), must be on the stream. The turn that saved them publishes them right
    after their commit, but on another replica, or late (a busy process, a crash before its
    publish), it could come after this turn's. So when this process has published them itself it
    goes on (or waits for that publish, still under way); otherwise it publishes them again under
    their ids first, and JetStream keeps whichever copy came first."""

    ROOMS_REMEMBERED = 4096  # rooms whose last publish this process remembers (the oldest forgotten)

    def __init__(self, bus: Bus) -> None:
        self.bus = bus
        # Per room, the first id of the replies this process published last, and whether that
        # publish succeeded (pending while under way).
        self._last: OrderedDict[uuid.UUID, tuple[uuid.UUID, asyncio.Future[bool]]] = OrderedDict()

    async def publish(self, agent_id: uuid.UUID, room_id: uuid.UUID, reply: Reply) -> bool:
        """Publishes one reply; False when the stream already had it (a duplicate)."""
        return await self.bus.publish(
            self.bus.subjects.outbound(str(agent_id), reply.source),
            reply.outbound(agent_id, room_id).SerializeToString(),
            msg_id=str(reply.id),
        )

    async def publish_turn(
        self, agent_id: uuid.UUID, room_id: uuid.UUID, replies: Sequence[Reply], earlier: Sequence[Reply]
    ) -> int:
        """Publishes a turn's replies after the room's ``earlier`` ones; returns how many of those
        this call put on the stream (their own turn had not published them yet)."""
        done: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        previous = self._last.pop(room_id, None)
        self._last[room_id] = (replies[0].id, done)
        if len(self._last) > self.ROOMS_REMEMBERED:
            self._last.popitem(last=False)
        stored = 0
        try:
            if earlier and not await _published(previous, earlier[0].id):
                for reply in earlier:
                    stored += await self.publish(agent_id, room_id, reply)
            for reply in replies:
                await self.publish(agent_id, room_id, reply)
        except BaseException:
            done.set_result(False)
            raise
        done.set_result(True)
        return stored


async def _published(previous: tuple[uuid.UUID, asyncio.Future[bool]] | None, first_id: uuid.UUID) -> bool:
    """Whether this process published the replies starting with ``first_id`` (waiting for that
    publish when it is still under way)."""
    if previous is None or previous[0] != first_id:
        return False
    return await asyncio.shield(previous[1])


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
        set_now(event.at)
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
