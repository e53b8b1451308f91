"""The bus side of the web connector, on the connector kit (parley_connectors): publish a user's
message, then hand its reply to the HTTP request waiting for it, as stream chunks while it is
generated and whole when it is complete.

The service is one connector serving every agent for source ``web``: replies come through its own
durable consumer on OUTBOUND (``web``, filtered to ``<ns>.outbound.*.web``), stream chunks from
``<ns>.stream.*.web`` (core NATS, best effort: a reply whose chunks were lost still arrives whole).
A reply nobody waits for any more (its request timed out or was closed) is acknowledged and
dropped: it is in the conversation's history already (the runtime's memories)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

from parley_connectors import Chunk, Connector, Inbound, Reply
from parley_platform import permissions
from parley_platform.bus import Bus
from parley_platform.errors import ParleyError
from parley_platform.logging import get_logger

log = get_logger(__name__)

SOURCE = permissions.WEB_SOURCE
# A turn that ends so publishes no reply: the request is answered at once instead of timing out.
NO_REPLY_OUTCOMES = frozenset({"superseded", "cancelled"})


@dataclass(frozen=True)
class Delta:
    """Text to append to the reply shown so far."""

    text: str


@dataclass(frozen=True)
class Done:
    """The end: the complete reply, or the outcome of a turn that ended without one."""

    text: str
    outcome: str = "completed"


Event = Delta | Done


class Waiter:
    """One request's view of its message's reply: deltas in order, then the end."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[Event] = asyncio.Queue()
        self.streamed = ""
        self.next_sequence = 1
        self.pending: dict[int, Chunk] = {}

    def chunk(self, chunk: Chunk) -> None:
        """Deltas are passed on in sequence order; a chunk after a gap waits for the missing one."""
        if chunk.sequence < self.next_sequence:
            return
        self.pending[chunk.sequence] = chunk
        while self.next_sequence in self.pending:
            ready = self.pending.pop(self.next_sequence)
            self.next_sequence += 1
            if ready.delta:
                self.streamed += ready.delta
                self.queue.put_nowait(Delta(ready.delta))
            if ready.final and ready.outcome in NO_REPLY_OUTCOMES:
                self.queue.put_nowait(Done("", ready.outcome))

    def done(self, text: str) -> None:
        # What did not stream (lost chunks, or no streaming at all) is passed on before the end.
        if text.startswith(self.streamed) and len(text) > len(self.streamed):
            self.queue.put_nowait(Delta(text[len(self.streamed) :]))
        self.queue.put_nowait(Done(text))

    async def events(self, timeout: float) -> AsyncIterator[Event]:
        """Until the end; TimeoutError when it has not come ``timeout`` seconds in."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            event = await asyncio.wait_for(self.queue.get(), max(0.0, deadline - loop.time()))
            yield event
            if isinstance(event, Done):
                return


class Relay:
    """Publishes inbound messages for source web and routes replies and chunks to their waiters."""

    def __init__(self, bus: Bus, *, publish_timeout: float = 5.0) -> None:
        self.bus = bus
        self.publish_timeout = publish_timeout
        self.waiters: dict[tuple[str, str], Waiter] = {}
        self.connector: Connector | None = None
        self.tasks: list[asyncio.Task[None]] = []

    async def start(self) -> None:
        self.connector = await Connector(
            self.bus,
            source=SOURCE,
            agent_ids=None,
            durable=permissions.WEB_DURABLE,
            namespace=self.bus.subjects.ns,
        ).start()
        chunks = await self.connector.chunks().start()
        self.tasks = [
            asyncio.create_task(self._replies(self.connector), name="web replies"),
            asyncio.create_task(self._chunks(chunks), name="web chunks"),
        ]

    async def stop(self, timeout: float) -> None:
        if self.connector is not None:
            await self.connector.close()
        for task in self.tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

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

    async def send(self, message: Inbound) -> None:
        assert self.connector is not None, "the relay is not started"
        await self.connector.send(message, retry_for=self.publish_timeout)

    async def cancel(self, agent_id: str, message_id: str, reason: str) -> None:
        """Ask the runtime to stop the turn of ``message_id`` (its reader went away)."""
        assert self.connector is not None, "the relay is not started"
        try:
            await self.connector.cancel(agent_id=agent_id, message_id=message_id, reason=reason)
        except ParleyError as exc:
            log.info("turn not cancelled", agent_id=agent_id, message_id=message_id, code=exc.code)

    async def _replies(self, connector: Connector) -> None:
        """Route every reply, for as long as the connector is open. An ack that fails leaves the
        reply to come again (its waiter, if any, took the first)."""
        while True:
            try:
                async for reply in connector.replies(poll=1.0):
                    self._route(reply)
                    await reply.ack()
                return
            except ParleyError as exc:
                log.warning("reading replies failed; again in a second", code=exc.code, error=exc.message)
                await asyncio.sleep(1)

    def _route(self, reply: Reply) -> None:
        waiter = self.waiters.get((reply.agent_id, reply.in_reply_to))
        if waiter is not None:
            waiter.done(reply.text)

    async def _chunks(self, chunks: AsyncIterator[Chunk]) -> None:
        async for chunk in chunks:
            waiter = self.waiters.get((chunk.agent_id, chunk.in_reply_to))
            if waiter is not None:
                waiter.chunk(chunk)
