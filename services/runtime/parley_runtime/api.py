"""The ``parley.v1.Runtime`` service, served over gRPC and NATS."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from datetime import datetime
from typing import Any

import yaml
from google.protobuf.message import DecodeError
from google.protobuf.timestamp_pb2 import Timestamp

from parley.v1 import runtime_pb2
from parley_platform.bus import Bus
from parley_platform.errors import DeadlineExceeded, InvalidArgument, NotFound
from parley_platform.paging import cut, page_of

from .agents import AgentDirectory, AgentInfo
from .character import parse_character
from .store import RuntimeStore
from .turn import ROOM_TYPES

ROOM_TYPE_VALUES: dict[str, Any] = {name: value for value, name in ROOM_TYPES.items() if value}
MEMORY_KINDS = {"messages", "facts", "documents", "fragments", "reflections"}
API_SOURCE = "api"


def _ts(value: datetime | None) -> Timestamp | None:
    if value is None:
        return None
    ts = Timestamp()
    ts.FromDatetime(value)
    return ts


def _uuid(value: str, field: str) -> uuid.UUID:
    try:
        return uuid.UUID(value)
    except ValueError:
        raise InvalidArgument(f"{field} must be a UUID", code="INVALID_ID") from None


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


class RuntimeApi:
    def __init__(
        self,
        *,
        store: RuntimeStore,
        bus: Bus,
        directory: AgentDirectory,
        waiters: ReplyWaiters,
        embed: Callable[[Sequence[str], uuid.UUID], Awaitable[list[list[float]]]],
    ) -> None:
        self.store = store
        self.bus = bus
        self.directory = directory
        self.waiters = waiters
        self.embed = embed

    async def find_agent(self, ref: str) -> AgentInfo:
        if not ref:
            raise InvalidArgument("agent_id is required (an agent id or name)", code="AGENT_REQUIRED")
        agent = await self.directory.find(ref)
        if agent is None:
            raise NotFound(
                f"no agent {ref[:100]!r}", code="AGENT_NOT_FOUND", hint="list them with `parley agents`"
            )
        return agent

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
            raise InvalidArgument(
                "character is required (a JSON or YAML character document)", code="CHARACTER_REQUIRED"
            )
        if len(text) > 1_000_000:
            raise InvalidArgument("character is over 1 MB", code="CHARACTER_TOO_LARGE")
        try:
            document = yaml.safe_load(text)  # JSON is YAML too
        except yaml.YAMLError as exc:
            raise InvalidArgument("character is neither JSON nor YAML", code="CHARACTER_INVALID") from exc
        agent = await self.directory.save(parse_character(document, "character"))
        return self.agent_message(agent)

    async def SetAgentEnabled(self, request: runtime_pb2.SetAgentEnabledRequest) -> runtime_pb2.Agent:
        agent = await self.find_agent(request.agent_id)
        return self.agent_message(await self.directory.set_enabled(agent, request.enabled))

    async def SearchMemories(
        self, request: runtime_pb2.SearchMemoriesRequest
    ) -> runtime_pb2.SearchMemoriesResponse:
        agent = await self.find_agent(request.agent_id)
        if not request.query.strip():
            raise InvalidArgument("query must not be empty", code="QUERY_REQUIRED")
        kind = request.table or "facts"
        if kind not in MEMORY_KINDS:
            raise InvalidArgument(
                f"table must be one of {', '.join(sorted(MEMORY_KINDS))}", code="INVALID_TABLE"
            )
        limit = request.limit or 10
        if not 1 <= limit <= 50:
            raise InvalidArgument("limit must be from 1 to 50", code="INVALID_LIMIT")
        room = _uuid(request.room_id, "room_id") if request.room_id else None
        [vector] = await self.embed([request.query], agent.id)
        rows = await self.store.search_memories(agent.id, vector, kind=kind, limit=limit, room_id=room)
        return runtime_pb2.SearchMemoriesResponse(
            hits=[
                runtime_pb2.MemoryHit(
                    memory=runtime_pb2.Memory(
                        id=str(r["id"]),
                        agent_id=str(agent.id),
                        table=r["kind"],
                        text=r["text"] or "",
                        created_at=_ts(r["created_at"]),
                    ),
                    similarity=float(r["similarity"]),
                )
                for r in rows
            ]
        )

    async def ListTurns(self, request: runtime_pb2.ListTurnsRequest) -> runtime_pb2.ListTurnsResponse:
        agent = await self.find_agent(request.agent_id)
        room = _uuid(request.room_id, "room_id") if request.room_id else None
        page = page_of(request.page if request.HasField("page") else None)
        rows, page_response = cut(page, await self.store.list_turns(agent.id, room, page.fetch, page.offset))
        return runtime_pb2.ListTurnsResponse(turns=[_turn(agent, r) for r in rows], page=page_response)

    async def GetTurn(self, request: runtime_pb2.GetTurnRequest) -> runtime_pb2.Turn:
        agent = await self.find_agent(request.agent_id)
        row = await self.store.get_turn(agent.id, _uuid(request.turn_id, "turn_id"))
        if row is None:
            raise NotFound(
                f"no turn {request.turn_id} for agent {agent.character.name!r}", code="TURN_NOT_FOUND"
            )
        turn = _turn(agent, row)
        if row.get("trajectory") is not None:
            turn.trajectory_json = json.dumps(agent.redactor.redact_obj(row["trajectory"]), sort_keys=True)
        return turn

    async def SendMessage(self, request: runtime_pb2.SendMessageRequest) -> runtime_pb2.SendMessageResponse:
        agent = await self.find_agent(request.agent_id)
        if not request.text.strip():
            raise InvalidArgument("text must not be empty", code="TEXT_REQUIRED")
        if request.timeout_seconds < 0 or request.timeout_seconds > 600:
            raise InvalidArgument("timeout_seconds must be from 0 to 600", code="INVALID_TIMEOUT")
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
        inbound.sent_at.GetCurrentTime()
        timeout = request.timeout_seconds or 30.0
        queue = self.waiters.open(str(agent.id), message_id)
        try:
            await self.bus.publish(
                self.bus.subjects.inbound(str(agent.id)),
                inbound.SerializeToString(),
                msg_id=f"{API_SOURCE}:{message_id}",
            )
            try:
                async with asyncio.timeout(timeout):
                    reply = await queue.get()
            except TimeoutError:
                raise DeadlineExceeded(
                    f"no reply from agent {agent.character.name!r} within {timeout:.0f}s",
                    code="REPLY_TIMEOUT",
                    hint="the message was accepted; the reply may still come",
                ) from None
        finally:
            self.waiters.close(str(agent.id), message_id)
        return runtime_pb2.SendMessageResponse(message_id=message_id, replies=[reply])

    async def ListAgents(self, request: runtime_pb2.ListAgentsRequest) -> runtime_pb2.ListAgentsResponse:
        page = page_of(request.page if request.HasField("page") else None)
        rows, page_response = cut(page, await self.store.list_agents(page.fetch, page.offset))
        agents = [
            runtime_pb2.Agent(
                id=str(r["id"]),
                name=r["name"],
                enabled=r["enabled"],
                bio=" ".join(r["character"].get("bio", [])),
                created_at=_ts(r["created_at"]),
            )
            for r in rows
        ]
        return runtime_pb2.ListAgentsResponse(agents=agents, page=page_response)

    async def ListRooms(self, request: runtime_pb2.ListRoomsRequest) -> runtime_pb2.ListRoomsResponse:
        agent = await self.find_agent(request.agent_id)
        page = page_of(request.page if request.HasField("page") else None)
        rows, page_response = cut(page, await self.store.list_rooms(agent.id, page.fetch, page.offset))
        rooms = [
            runtime_pb2.Room(
                id=str(r["id"]),
                agent_id=str(agent.id),
                source=r["source"],
                channel_id=r["channel_id"],
                type=ROOM_TYPE_VALUES.get(r["type"], 0),
                world_id=r["world_external_id"] or "",
                created_at=_ts(r["created_at"]),
            )
            for r in rows
        ]
        return runtime_pb2.ListRoomsResponse(rooms=rooms, page=page_response)

    async def ListMemories(
        self, request: runtime_pb2.ListMemoriesRequest
    ) -> runtime_pb2.ListMemoriesResponse:
        agent = await self.find_agent(request.agent_id)
        kind = request.table or "messages"
        if kind not in MEMORY_KINDS:
            raise InvalidArgument(
                f"table must be one of {', '.join(sorted(MEMORY_KINDS))}", code="INVALID_TABLE"
            )
        room = _uuid(request.room_id, "room_id") if request.room_id else None
        page = page_of(request.page if request.HasField("page") else None)
        rows, page_response = cut(
            page, await self.store.list_memories(agent.id, kind, room, page.fetch, page.offset)
        )
        memories = []
        for r in rows:
            content = r["content"]
            memories.append(
                runtime_pb2.Memory(
                    id=str(r["id"]),
                    agent_id=str(agent.id),
                    room_id=str(r["room_id"] or ""),
                    entity_id=str(r["entity_id"] or ""),
                    table=r["kind"],
                    text=content.get("text", ""),
                    actions=content.get("actions", []),
                    thought=content.get("thought", ""),
                    source=r["source"] or "",
                    in_reply_to=str(r["in_reply_to"] or ""),
                    created_at=_ts(r["created_at"]),
                )
            )
        return runtime_pb2.ListMemoriesResponse(memories=memories, page=page_response)


def _turn(agent: AgentInfo, row: Mapping[str, Any]) -> runtime_pb2.Turn:
    return runtime_pb2.Turn(
        id=str(row["id"]),
        agent_id=str(agent.id),
        room_id=str(row["room_id"]),
        state=row["state"],
        reason=row.get("reason") or "",
        attempts=row["attempts"],
        response_id=str(row["response_id"] or ""),
        error=agent.redactor.redact(row["error"] or ""),
        stream_sequence=row["stream_seq"],
        received_at=_ts(row["received_at"]),
        started_at=_ts(row.get("started_at")),
        finished_at=_ts(row.get("finished_at")),
    )
