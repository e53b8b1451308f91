"""Talking to the suite from the command line: gRPC for operators, NATS for the terminal connector."""

from __future__ import annotations

import asyncio
import os
import re
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import grpc
from google.protobuf.message import Message

from parley.v1 import common_pb2, runtime_pb2, runtime_pb2_grpc
from parley_connectors import Chunk, Chunks, Connector, Inbound, Reply
from parley_platform.bus import Bus
from parley_platform.errors import DeadlineExceeded, FailedPrecondition, NotFound, Unauthenticated
from parley_platform.grpcserver import error_from_rpc_error, open_channel

from . import config

TERMINAL_SOURCE = "terminal"
Call = Callable[..., Awaitable[Any]]


def caller(service: str, stub_class: Callable[[grpc.aio.Channel], object], timeout: float = 10.0) -> Call:
    """``call(method, request, timeout=...)``: one RPC of a gRPC service of the suite, sent with the
    operator token. A service that is not running and every Parley error become a clear ParleyError."""
    default_timeout = timeout

    async def call(method: str, request: Message, timeout: float = default_timeout) -> Any:
        token = config.operator_token()
        if token is None:
            raise Unauthenticated(
                "no operator token: set PARLEY_OPERATOR_TOKEN",
                hint="`parley run` writes one to .parley/operator-token",
            )
        async with open_channel(config.grpc_address(service), tls_ca=config.grpc_tls_ca()) as channel:
            rpc = getattr(stub_class(channel), method)
            try:
                return await rpc(request, metadata=[("authorization", f"Bearer {token}")], timeout=timeout)
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.UNAVAILABLE:
                    raise FailedPrecondition(
                        f"the {service} is not reachable at {config.grpc_address(service)}",
                        code="SERVICE_UNREACHABLE",
                        hint=f"start the suite with `make run` (or set {config.address_env(service)})",
                    ) from exc
                raise error_from_rpc_error(exc) from exc

    return call


runtime = caller("runtime", runtime_pb2_grpc.RuntimeStub)


async def list_agents() -> list[runtime_pb2.Agent]:
    agents: list[runtime_pb2.Agent] = []
    page = common_pb2.PageRequest(limit=100)
    while True:
        reply = await runtime("ListAgents", runtime_pb2.ListAgentsRequest(page=page))
        agents.extend(reply.agents)
        if not reply.page.has_more:
            return agents
        page.offset = reply.page.next_offset


async def resolve_agent(ref: str) -> runtime_pb2.Agent:
    for agent in await list_agents():
        if ref in (agent.id, agent.name):
            return agent
    raise NotFound(f"no agent named {ref!r}", code="AGENT_NOT_FOUND", hint="list them with `parley agents`")


async def agent_id(ref: str) -> str:
    """An agent id as given (a UUID; empty stays empty), else the id of the agent with that name."""
    if not ref:
        return ref
    try:
        return str(uuid.UUID(ref))
    except ValueError:
        return (await resolve_agent(ref)).id


# A user's terminal consumer is removed after a week without a chat: the replies it kept are
# past the OUTBOUND stream's retention (7 days) by then anyway.
FORGET_AFTER = 7 * 24 * 3600.0


def terminal_durable(user: str, agent_id: str) -> str:
    """The terminal's durable consumer of an agent's replies, one per user: what it did not show
    (a reply produced while no chat was open) waits there for the next chat."""
    return "terminal-" + re.sub(r"[^A-Za-z0-9_-]", "_", user)[:64] + "-" + agent_id


class TerminalConnector:
    """A connector like any other, on the connector kit: publishes the user's messages, receives the
    agent's replies through the user's durable consumer and its stream chunks as they arrive."""

    def __init__(self, connector: Connector, agent_id: str, user: str) -> None:
        self.connector = connector
        self.agent_id = agent_id
        self.user = user
        self.channel = f"terminal:{user}"
        self.events: asyncio.Queue[Reply | Chunk] = asyncio.Queue()

    @classmethod
    @asynccontextmanager
    async def open(cls, agent_id: str, user: str | None = None) -> AsyncIterator[TerminalConnector]:
        """Connected to NATS as the operator, receiving the agent's replies to `user`'s terminal
        (default: $USER)."""
        url = config.nats_url()
        if url is None:
            raise FailedPrecondition(
                "NATS is not configured",
                code="NATS_UNKNOWN",
                hint="start the suite with `make run`, or set PARLEY_NATS_URL",
            )
        nats_user, nats_password = config.nats_credentials()
        bus = await Bus.connect(
            url,
            name="parley-cli",
            namespace=config.namespace(),
            connect_timeout=3,
            user=nats_user,
            password=nats_password,
        )
        name = user or os.environ.get("USER", "you")
        try:
            connector = Connector(
                bus,
                source=TERMINAL_SOURCE,
                agent_ids=[agent_id],
                durable=terminal_durable(name, agent_id),
                owns_bus=True,
                forget_after=FORGET_AFTER,
            )
            await connector.start()
        except BaseException:
            await bus.close()
            raise
        terminal = cls(connector, agent_id, name)
        async with connector, connector.chunks() as chunks:
            tasks = [asyncio.create_task(terminal._replies()), asyncio.create_task(terminal._chunks(chunks))]
            try:
                yield terminal
            finally:
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)

    async def _replies(self) -> None:
        async for reply in self.connector.replies(poll=1):
            if reply.channel_id == self.channel:
                self.events.put_nowait(reply)
            else:
                await reply.ack()  # another user's terminal: theirs to show

    async def _chunks(self, chunks: Chunks) -> None:
        async for chunk in chunks:
            if chunk.channel_id == self.channel:
                self.events.put_nowait(chunk)

    async def pending(self) -> int:
        """How many replies wait in this user's consumer (produced while no terminal was open)."""
        info = await self.connector.bus.js.consumer_info(self.connector.stream, self.connector.durable)
        return int(info.num_pending or 0) + int(info.num_ack_pending or 0)

    async def send(self, text: str) -> str:
        message_id = uuid.uuid4().hex
        await self.connector.send(
            Inbound(
                message_id=message_id,
                sender_id=self.user,
                sender_name=self.user,
                channel_id=self.channel,
                room_type="dm",
                text=text,
            ),
            retry_for=10,
        )
        return message_id

    async def reply_to(
        self,
        message_id: str,
        timeout: float,
        *,
        on_chunk: Callable[[Chunk], None] | None = None,
        on_other: Callable[[Reply], None] | None = None,
    ) -> Reply:
        """The reply to ``message_id``, acknowledged. Its stream chunks go to ``on_chunk`` as they
        arrive; this terminal's other replies to ``on_other`` (and are acknowledged), or, without
        it, are left for a later chat."""
        try:
            async with asyncio.timeout(timeout):
                while True:
                    event = await self.events.get()
                    if isinstance(event, Chunk):
                        if event.in_reply_to == message_id and on_chunk is not None:
                            on_chunk(event)
                        if event.in_reply_to == message_id and event.final and event.outcome in ENDED:
                            raise FailedPrecondition(
                                f"the turn was {event.outcome}",
                                code=f"TURN_{event.outcome.upper()}",
                                hint=ENDED[event.outcome],
                            )
                    elif event.in_reply_to == message_id:
                        await event.ack()
                        return event
                    elif on_other is not None:
                        on_other(event)
                        await event.ack()
                    else:
                        await event.retry_later(1.0)
        except TimeoutError:
            raise DeadlineExceeded(
                f"no reply within {timeout:g}s",
                code="REPLY_TIMEOUT",
                hint="is the suite running (`make run`)? see .parley/logs/",
            ) from None

    def waiting(self) -> list[Reply]:
        """The replies received and not shown yet (the chunks are dropped: their reply came whole)."""
        found: list[Reply] = []
        while not self.events.empty():
            event = self.events.get_nowait()
            if isinstance(event, Reply):
                found.append(event)
        return found


# A turn that ended without a reply: its final chunk says why (and so, at once, does `parley send`).
ENDED = {
    "ignored": "the agent chose not to answer this message (see `parley turns`)",
    "superseded": "a newer message in the conversation took the turn over",
    "cancelled": "the turn was cancelled before it replied",
    "failed": "see `parley turns` and the runtime's log",
}
