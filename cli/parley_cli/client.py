"""Talking to the suite from the command line: gRPC for operators, NATS for the terminal connector."""

from __future__ import annotations

import asyncio
import os
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import grpc
from google.protobuf.message import Message

from parley.v1 import common_pb2, runtime_pb2, runtime_pb2_grpc
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


class TerminalConnector:
    """A connector like any other: publishes inbound messages, receives outbound ones."""

    def __init__(self, bus: Bus, agent_id: str, user: str) -> None:
        self.bus = bus
        self.agent_id = agent_id
        self.user = user
        self.replies: asyncio.Queue[runtime_pb2.OutboundMessage] = asyncio.Queue()

    @classmethod
    @asynccontextmanager
    async def open(cls, agent_id: str, user: str | None = None) -> AsyncIterator[TerminalConnector]:
        """Connected to NATS as `user` (default: $USER), receiving the agent's replies to the terminal."""
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
        connector = cls(bus, agent_id, user or os.environ.get("USER", "you"))
        try:
            await bus.subscribe(bus.subjects.outbound(agent_id, TERMINAL_SOURCE), connector._on_reply)
            yield connector
        finally:
            await bus.close()

    async def _on_reply(self, msg: Any) -> None:
        self.replies.put_nowait(runtime_pb2.OutboundMessage.FromString(msg.data))

    async def send(self, text: str) -> str:
        message_id = uuid.uuid4().hex
        inbound = runtime_pb2.InboundMessage(
            agent_id=self.agent_id,
            source=TERMINAL_SOURCE,
            message_id=message_id,
            sender_id=self.user,
            sender_name=self.user,
            channel_id=f"terminal:{self.user}",
            room_type=runtime_pb2.ROOM_TYPE_DM,
            text=text,
        )
        inbound.sent_at.GetCurrentTime()
        await self.bus.publish(
            self.bus.subjects.inbound(self.agent_id, TERMINAL_SOURCE),
            inbound.SerializeToString(),
            msg_id=f"{TERMINAL_SOURCE}:{message_id}",
        )
        return message_id

    async def reply_to(self, message_id: str, timeout: float) -> runtime_pb2.OutboundMessage:
        try:
            async with asyncio.timeout(timeout):
                while True:
                    reply = await self.replies.get()
                    if reply.in_reply_to == message_id:
                        return reply
        except TimeoutError:
            raise DeadlineExceeded(
                f"no reply within {timeout:g}s",
                code="REPLY_TIMEOUT",
                hint="is the suite running (`make run`)? see .parley/logs/",
            ) from None
