"""The ``parley.v1.Runtime`` service, served over gRPC and NATS."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import yaml
from google.protobuf.message import DecodeError

from parley.v1 import runtime_pb2
from parley_platform.bus import Bus
from parley_platform.convert import set_now, timestamp, uuid_of
from parley_platform.paging import cut, page_of

from . import errors
from .admin_api import AdminApi
from .admin_store import AdminStore
from .agents.directory import AgentDirectory, AgentInfo
from .autonomy.service import Autonomy
from .character import parse_character
from .records import TurnRecord
from .store import RuntimeStore

MEMORY_KINDS = {"messages", "facts", "documents", "fragments", "reflections"}
API_SOURCE = "api"


class ReplyWaiters:
    """Routes replies seen on ``<ns>.outbound.*.api`` to the SendMessage calls awaiting them."""

    def __init__(self) -> None:
        self._waiting: dict[tuple[str, str], asyncio.Queue[runtime_pb2.OutboundMessage]] = {}

    def open(self, agent_id: str, message_id: str) -> asyncio.Queue[runtime_pb2.OutboundMessage]:
        queue: asyncio.Queue[runtime_pb2.OutboundMessage] = asyncio.Queue()
        self._waiting[(agent_id, message_id)] = queue
        return queue

    def close(self, agent_id: str, message_id: str) -> None:
        self._waiting.pop((agent_id, message_id), None)

    async def on_message(self, msg: Any) -> None:
        try:
            outbound = runtime_pb2.OutboundMessage.FromString(msg.data)
        except DecodeError:
            return
        queue = self._waiting.get((outbound.agent_id, outbound.in_reply_to))
        if queue is not None:
            queue.put_nowait(outbound)


class RuntimeApi(AdminApi):
    def __init__(
        self,
        *,
        store: RuntimeStore,
        bus: Bus,
        directory: AgentDirectory,
        waiters: ReplyWaiters,
        embed: Callable[[Sequence[str], uuid.UUID], Awaitable[list[list[float]]]],
        autonomy: Autonomy,
    ) -> None:
        self.autonomy = autonomy
        self.store = store
        self.admin = AdminStore(store.db)
        self.bus = bus
        self.directory = directory
        self.waiters = waiters
        self.embed = embed

    async def find_agent(self, ref: str) -> AgentInfo:
        return await self.directory.require(ref)

    @staticmethod
    def agent_message(agent: AgentInfo) -> runtime_pb2.Agent:
        return runtime_pb2.Agent(
            id=str(agent.id),
            name=agent.character.name,
            enabled=agent.enabled,
            bio=" ".join(agent.character.bio),
        )

    async def UpsertAgent(self, request: runtime_pb2.UpsertAgentRequest) -> runtime_pb2.Agent:
        text = request.character.strip()
        if not text:
            raise errors.CHARACTER_REQUIRED("character is required (a JSON or YAML character document)")
        if len(text) > 1_000_000:
            raise errors.CHARACTER_TOO_LARGE("character is over 1 MB")
        try:
            document = yaml.safe_load(text)  # JSON is YAML too
        except yaml.YAMLError as exc:
            raise errors.CHARACTER_INVALID("character is neither JSON nor YAML") from exc
        character = parse_character(document, "character")
        agent = await self.directory.save(character)
        reply = self.agent_message(agent)
        reply.warnings.extend(character.warnings)
        return reply

    async def SetAgentEnabled(self, request: runtime_pb2.SetAgentEnabledRequest) -> runtime_pb2.Agent:
        agent = await self.find_agent(request.agent_id)
        return self.agent_message(await self.directory.set_enabled(agent, request.enabled))

    async def SearchMemories(
        self, request: runtime_pb2.SearchMemoriesRequest
    ) -> runtime_pb2.SearchMemoriesResponse:
        agent = await self.find_agent(request.agent_id)
        if not request.query.strip():
            raise errors.QUERY_REQUIRED("query must not be empty")
        kind = request.table or "facts"
        if kind not in MEMORY_KINDS:
            raise errors.INVALID_TABLE(f"table must be one of {', '.join(sorted(MEMORY_KINDS))}")
        limit = request.limit or 10
        if not 1 <= limit <= 50:
            raise errors.INVALID_LIMIT("limit must be from 1 to 50")
        room = uuid_of(request.room_id, "room_id") if request.room_id else None
        [vector] = await self.embed([request.query], agent.id)
        found = await self.store.search_memories(agent.id, vector, kind=kind, limit=limit, room_id=room)
        return runtime_pb2.SearchMemoriesResponse(
            hits=[
                runtime_pb2.MemoryHit(
                    memory=runtime_pb2.Memory(
                        id=str(m.id),
                        agent_id=str(agent.id),
                        table=m.kind,
                        text=m.text,
                        created_at=timestamp(m.created_at),
                    ),
                    similarity=m.similarity,
                )
                for m in found
            ]
        )

    async def ListTurns(self, request: runtime_pb2.ListTurnsRequest) -> runtime_pb2.ListTurnsResponse:
        agent = await self.find_agent(request.agent_id)
        room = uuid_of(request.room_id, "room_id") if request.room_id else None
        page = page_of(request.page if request.HasField("page") else None)
        turns, page_response = cut(page, await self.store.list_turns(agent.id, room, page.fetch, page.offset))
        return runtime_pb2.ListTurnsResponse(turns=[_turn(agent, t) for t in turns], page=page_response)

    async def GetTurn(self, request: runtime_pb2.GetTurnRequest) -> runtime_pb2.Turn:
        agent = await self.find_agent(request.agent_id)
        record = await self.store.get_turn(agent.id, uuid_of(request.turn_id, "turn_id"))
        if record is None:
            raise errors.TURN_NOT_FOUND(f"no turn {request.turn_id} for agent {agent.character.name!r}")
        turn = _turn(agent, record)
        if record.trajectory is not None:
            turn.trajectory_json = json.dumps(agent.redactor.redact_obj(record.trajectory), sort_keys=True)
        return turn

    async def SendMessage(self, request: runtime_pb2.SendMessageRequest) -> runtime_pb2.SendMessageResponse:
        agent = await self.find_agent(request.agent_id)
        if not request.text.strip():
            raise errors.TEXT_REQUIRED("text must not be empty")
        if request.timeout_seconds < 0 or request.timeout_seconds > 600:
            raise errors.INVALID_TIMEOUT("timeout_seconds must be from 0 to 600")
        sender = request.sender_id or "operator"
        message_id = request.message_id or uuid.uuid4().hex
        inbound = runtime_pb2.InboundMessage(
            agent_id=str(agent.id),
            source=API_SOURCE,
            message_id=message_id,
            sender_id=sender,
            sender_name=request.sender_name or sender,
            channel_id=request.channel_id or f"operator:{sender}",
            room_type=request.room_type or runtime_pb2.ROOM_TYPE_API,
            text=request.text,
        )
        set_now(inbound.sent_at)
        timeout = request.timeout_seconds or 30.0
        queue = self.waiters.open(str(agent.id), message_id)
        try:
            await self.bus.publish(
                self.bus.subjects.inbound(str(agent.id), API_SOURCE),
                inbound.SerializeToString(),
                msg_id=f"{API_SOURCE}:{message_id}",
            )
            try:
                async with asyncio.timeout(timeout):
                    reply = await queue.get()
            except TimeoutError:
                raise errors.REPLY_TIMEOUT(
                    f"no reply from agent {agent.character.name!r} within {timeout:.0f}s"
                ) from None
        finally:
            self.waiters.close(str(agent.id), message_id)
        return runtime_pb2.SendMessageResponse(message_id=message_id, replies=[reply])

    async def ListAgents(self, request: runtime_pb2.ListAgentsRequest) -> runtime_pb2.ListAgentsResponse:
        page = page_of(request.page if request.HasField("page") else None)
        stored, page_response = cut(page, await self.store.list_agents(page.fetch, page.offset))
        agents = [
            runtime_pb2.Agent(
                id=str(a.id),
                name=a.name,
                enabled=a.enabled,
                bio=" ".join(a.character.get("bio", [])),
                created_at=timestamp(a.created_at),
            )
            for a in stored
        ]
        return runtime_pb2.ListAgentsResponse(agents=agents, page=page_response)

    async def ListMemories(
        self, request: runtime_pb2.ListMemoriesRequest
    ) -> runtime_pb2.ListMemoriesResponse:
        agent = await self.find_agent(request.agent_id)
        kind = request.table or "messages"
        if kind not in MEMORY_KINDS:
            raise errors.INVALID_TABLE(f"table must be one of {', '.join(sorted(MEMORY_KINDS))}")
        room = uuid_of(request.room_id, "room_id") if request.room_id else None
        page = page_of(request.page if request.HasField("page") else None)
        found, page_response = cut(
            page, await self.store.list_memories(agent.id, kind, room, page.fetch, page.offset)
        )
        memories = [
            runtime_pb2.Memory(
                id=str(m.id),
                agent_id=str(agent.id),
                room_id=str(m.room_id or ""),
                entity_id=str(m.entity_id or ""),
                table=m.kind,
                text=m.content.get("text", ""),
                actions=m.content.get("actions", []),
                thought=m.content.get("thought", ""),
                source=m.source or "",
                in_reply_to=str(m.in_reply_to or ""),
                created_at=timestamp(m.created_at),
            )
            for m in found
        ]
        return runtime_pb2.ListMemoriesResponse(memories=memories, page=page_response)

    async def SetAutonomy(self, request: runtime_pb2.SetAutonomyRequest) -> runtime_pb2.AutonomyStatus:
        return await self.autonomy.set(await self.find_agent(request.agent_id), request.enabled)

    async def GetAutonomy(self, request: runtime_pb2.GetAutonomyRequest) -> runtime_pb2.AutonomyStatus:
        return await self.autonomy.status(await self.find_agent(request.agent_id))


def _turn(agent: AgentInfo, record: TurnRecord) -> runtime_pb2.Turn:
    return runtime_pb2.Turn(
        id=str(record.id),
        agent_id=str(agent.id),
        room_id=str(record.room_id),
        state=record.state,
        reason=record.reason or "",
        attempts=record.attempts,
        response_id=str(record.response_id or ""),
        error=agent.redactor.redact(record.error or ""),
        stream_sequence=record.stream_seq,
        received_at=timestamp(record.received_at),
        started_at=timestamp(record.started_at),
        finished_at=timestamp(record.finished_at),
        origin=record.origin,
    )
