"""The bus side of the web connector: publish a user's message, then hand its reply to the HTTP
request waiting for it, as stream chunks while it is generated and whole when it is complete.

Replies come through the service's own durable consumer on OUTBOUND (``web``, filtered to source
``web``): one produced while the connection to NATS was down is delivered when it returns. Stream
chunks are core NATS (best effort): a reply whose chunks were lost still arrives whole. A reply
nobody waits for any more (its request timed out or was closed) is acknowledged and dropped: it is
in the conversation's history already (the runtime's memories)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from google.protobuf.message import DecodeError

from parley.v1 import runtime_pb2
from parley_platform import permissions
from parley_platform.bus import Bus, ConsumerSpec
from parley_platform.consumer import Delivery, Poison, PullConsumer
from parley_platform.logging import get_logger
from parley_platform.metrics import MessagingMetrics

log = get_logger(__name__)

SOURCE = permissions.WEB_SOURCE


@dataclass(frozen=True)
class Delta:
    """Text to append to the reply shown so far."""

    text: str


@dataclass(frozen=True)
class Done:
    """The complete reply (its text is the whole reply, whatever streamed before)."""

    reply: runtime_pb2.OutboundMessage


Event = Delta | Done


class Waiter:
    """One request's view of its message's reply: deltas in order, then the complete reply."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[Event] = asyncio.Queue()
        self.streamed = ""
        self.next_sequence = 1
        self.pending: dict[int, str] = {}

    def chunk(self, chunk: runtime_pb2.StreamChunk) -> None:
        """Deltas are passed on in sequence order; a chunk after a gap waits for the missing one."""
        if chunk.sequence < self.next_sequence:
            return
        self.pending[chunk.sequence] = chunk.delta
        while self.next_sequence in self.pending:
            delta = self.pending.pop(self.next_sequence)
            self.next_sequence += 1
            if delta:
                self.streamed += delta
                self.queue.put_nowait(Delta(delta))

    def done(self, reply: runtime_pb2.OutboundMessage) -> None:
        # What did not stream (lost chunks, or no streaming at all) is passed on before the end.
        if reply.text.startswith(self.streamed) and len(reply.text) > len(self.streamed):
            self.queue.put_nowait(Delta(reply.text[len(self.streamed) :]))
        self.queue.put_nowait(Done(reply))

    async def events(self, timeout: float) -> AsyncIterator[Event]:
        """Until the complete reply; TimeoutError when it is not there ``timeout`` seconds in."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            event = await asyncio.wait_for(self.queue.get(), max(0.0, deadline - loop.time()))
            yield event
            if isinstance(event, Done):
                return


class Relay:
    """Publishes inbound messages for source web and routes replies and chunks to their waiters."""

    def __init__(self, bus: Bus, metrics: MessagingMetrics | None = None) -> None:
        self.bus = bus
        self.waiters: dict[tuple[str, str], Waiter] = {}
        outbound = bus.subjects.stream("OUTBOUND")
        self.consumer = PullConsumer(
            bus,
            ConsumerSpec(
                stream=outbound,
                durable=permissions.WEB_DURABLE,
                filter_subject=bus.subjects.outbound("*", SOURCE),
                # A name with the durable one: the server is asked with the filter in the subject,
                # which is all the web identity may create.
                extra={"name": permissions.WEB_DURABLE},
            ),
            self._on_reply,
            metrics=metrics,
            fetch_timeout=0.5,
        )
        self._chunks: Any = None

    async def start(self) -> None:
        self._chunks = await self.bus.subscribe(f"{self.bus.subjects.ns}.stream.*.{SOURCE}", self._on_chunk)
        await self.consumer.start()

    async def stop(self, timeout: float) -> None:
        await self.consumer.stop(timeout)
        if self._chunks is not None:
            with contextlib.suppress(Exception):
                await self._chunks.unsubscribe()

    @contextlib.asynccontextmanager
    async def waiting(self, agent_id: str, message_id: str) -> AsyncIterator[Waiter]:
        """Register for the reply to ``message_id`` before publishing it, so none is missed."""
        key = (agent_id, message_id)
        waiter = Waiter()
        self.waiters[key] = waiter
        try:
            yield waiter
        finally:
            if self.waiters.get(key) is waiter:
                del self.waiters[key]

    async def send(self, message: runtime_pb2.InboundMessage) -> None:
        await self.bus.publish(
            self.bus.subjects.inbound(message.agent_id, SOURCE),
            message.SerializeToString(),
            msg_id=f"{SOURCE}:{message.message_id}",
        )

    async def cancel(self, agent_id: str, message_id: str, reason: str) -> None:
        """Ask the runtime to stop the turn of ``message_id`` (its reader went away)."""
        request = runtime_pb2.CancelTurnRequest(
            agent_id=agent_id, source=SOURCE, message_id=message_id, reason=reason
        )
        await self.bus.publish_core(
            f"{self.bus.subjects.ns}.cancel.{agent_id}.{SOURCE}", request.SerializeToString()
        )

    async def _on_reply(self, delivery: Delivery) -> None:
        try:
            reply = runtime_pb2.OutboundMessage.FromString(delivery.data)
        except DecodeError as exc:
            raise Poison(f"not an OutboundMessage: {exc}") from exc
        waiter = self.waiters.get((reply.agent_id, reply.in_reply_to))
        if waiter is not None:
            waiter.done(reply)

    async def _on_chunk(self, msg: Any) -> None:
        try:
            chunk = runtime_pb2.StreamChunk.FromString(msg.data)
        except DecodeError:
            log.warning("malformed stream chunk dropped", subject=msg.subject)
            return
        waiter = self.waiters.get((chunk.agent_id, chunk.in_reply_to))
        if waiter is not None:
            waiter.chunk(chunk)
