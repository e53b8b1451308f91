"""Operator administration over gRPC and NATS (part of ``parley.v1.Runtime``): the agent's rooms,
worlds, entities, participants and relationships; an entity's role in a room; muting the agent in a
room or a whole world, for good, until a time or for a duration. Operator only: connectors and
services cannot call the runtime's RPCs (see parley_platform/permissions.py)."""

from __future__ import annotations

import json
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any, Protocol

from parley.v1 import runtime_pb2
from parley_platform.convert import datetime_of, timestamp, uuid_of
from parley_platform.paging import cut, page_of

from . import errors
from .admin_store import AdminStore
from .agents.directory import AgentInfo
from .names import ROLES, ROOM_TYPE_VALUES
from .records import MuteState, Row
from .store import RuntimeStore

MAX_MUTE = timedelta(days=366)


class _Api(Protocol):
    store: RuntimeStore
    admin: AdminStore

    async def find_agent(self, ref: str) -> AgentInfo: ...


def _optional_uuid(value: str, field: str) -> uuid.UUID | None:
    return uuid_of(value, field) if value else None


def _page(request: Any) -> Any:
    return page_of(request.page if request.HasField("page") else None)


def _muted(state: str | None, until: datetime | None, now: datetime) -> tuple[bool, datetime | None]:
    muted, _ = MuteState(state, until).active(now)
    return muted, until if muted else None


def participant_message(row: Row) -> runtime_pb2.RoomParticipant:
    return runtime_pb2.RoomParticipant(
        room_id=str(row["room_id"]),
        entity_id=str(row["entity_id"]),
        names=list(row["names"] or []),
        role=row["role"],
        role_source=row["role_source"],
        state=row["user_state"] or "",
        mute_until=timestamp(row["mute_until"]),
        created_at=timestamp(row["created_at"]),
    )


class AdminApi:
    async def ListRooms(self: _Api, request: runtime_pb2.ListRoomsRequest) -> runtime_pb2.ListRoomsResponse:
        agent = await self.find_agent(request.agent_id)
        world = _optional_uuid(request.world_id, "world_id")
        page = _page(request)
        found, page_response = cut(
            page, await self.admin.list_rooms_admin(agent.id, world, page.fetch, page.offset)
        )
        now = datetime.now(UTC)
        rooms = []
        for r in found:
            muted, until = _muted(r["user_state"], r["mute_until"], now)
            rooms.append(
                runtime_pb2.Room(
                    id=str(r["id"]),
                    agent_id=str(agent.id),
                    source=r["source"],
                    channel_id=r["channel_id"],
                    type=ROOM_TYPE_VALUES.get(r["type"], 0),  # type: ignore[arg-type]
                    world_id=r["world_external_id"] or "",
                    created_at=timestamp(r["created_at"]),
                    muted=muted,
                    mute_until=timestamp(until),
                    world=str(r["world_id"] or ""),
                    name=r["name"],
                )
            )
        return runtime_pb2.ListRoomsResponse(rooms=rooms, page=page_response)

    async def ListWorlds(
        self: _Api, request: runtime_pb2.ListWorldsRequest
    ) -> runtime_pb2.ListWorldsResponse:
        agent = await self.find_agent(request.agent_id)
        page = _page(request)
        found, page_response = cut(page, await self.admin.list_worlds(agent.id, page.fetch, page.offset))
        now = datetime.now(UTC)
        worlds = []
        for w in found:
            metadata = w["metadata"] or {}
            mute = MuteState.from_json(
                {"state": metadata.get("agent_mute_state"), "until": metadata.get("agent_mute_until")}
            )
            muted, until = _muted(mute.state, mute.until, now) if mute else (False, None)
            roles = metadata.get("roles")
            roles = roles if isinstance(roles, dict) else {}
            worlds.append(
                runtime_pb2.World(
                    id=str(w["id"]),
                    agent_id=str(agent.id),
                    source=w["source"],
                    external_id=w["external_id"],
                    name=w["name"],
                    rooms=w["rooms"],
                    muted=muted,
                    mute_until=timestamp(until),
                    roles={str(k): str(v).upper() for k, v in roles.items()},
                    created_at=timestamp(w["created_at"]),
                )
            )
        return runtime_pb2.ListWorldsResponse(worlds=worlds, page=page_response)

    async def ListEntities(
        self: _Api, request: runtime_pb2.ListEntitiesRequest
    ) -> runtime_pb2.ListEntitiesResponse:
        agent = await self.find_agent(request.agent_id)
        room = _optional_uuid(request.room_id, "room_id")
        page = _page(request)
        found, page_response = cut(
            page, await self.admin.list_entities(agent.id, room, page.fetch, page.offset)
        )
        entities = [
            runtime_pb2.Entity(
                id=str(e["id"]),
                agent_id=str(agent.id),
                names=list(e["names"] or []),
                metadata_json=json.dumps(e["metadata"] or {}, sort_keys=True),
                created_at=timestamp(e["created_at"]),
            )
            for e in found
        ]
        return runtime_pb2.ListEntitiesResponse(entities=entities, page=page_response)

    async def ListParticipants(
        self: _Api, request: runtime_pb2.ListParticipantsRequest
    ) -> runtime_pb2.ListParticipantsResponse:
        agent = await self.find_agent(request.agent_id)
        room = _optional_uuid(request.room_id, "room_id")
        entity = _optional_uuid(request.entity_id, "entity_id")
        page = _page(request)
        found, page_response = cut(
            page, await self.admin.list_participants(agent.id, room, entity, page.fetch, page.offset)
        )
        return runtime_pb2.ListParticipantsResponse(
            participants=[participant_message(p) for p in found], page=page_response
        )

    async def ListRelationships(
        self: _Api, request: runtime_pb2.ListRelationshipsRequest
    ) -> runtime_pb2.ListRelationshipsResponse:
        agent = await self.find_agent(request.agent_id)
        entity = _optional_uuid(request.entity_id, "entity_id")
        page = _page(request)
        found, page_response = cut(
            page,
            await self.admin.list_relationships(
                agent.id, entity, request.tag or None, page.fetch, page.offset
            ),
        )
        relationships = [
            runtime_pb2.Relationship(
                id=str(r["id"]),
                agent_id=str(agent.id),
                source_entity_id=str(r["source_entity_id"]),
                target_entity_id=str(r["target_entity_id"]),
                tags=list(r["tags"] or []),
                metadata_json=json.dumps(r["metadata"] or {}, sort_keys=True),
                created_at=timestamp(r["created_at"]),
                updated_at=timestamp(r["updated_at"]),
            )
            for r in found
        ]
        return runtime_pb2.ListRelationshipsResponse(relationships=relationships, page=page_response)

    async def SetParticipantRole(
        self: _Api, request: runtime_pb2.SetParticipantRoleRequest
    ) -> runtime_pb2.RoomParticipant:
        agent = await self.find_agent(request.agent_id)
        room = uuid_of(request.room_id, "room_id")
        entity = uuid_of(request.entity_id, "entity_id")
        role = request.role.strip().upper()
        if role not in ROLES:
            raise errors.INVALID_ROLE(f"role must be one of {', '.join(ROLES)}")
        row = await self.admin.set_participant_role(agent.id, room, entity, role)
        if row is None:
            raise errors.PARTICIPANT_NOT_FOUND(
                f"agent {agent.character.name!r} has no room {room} or no entity {entity}"
            )
        return participant_message(row)

    async def SetMute(self: _Api, request: runtime_pb2.SetMuteRequest) -> runtime_pb2.MuteState:
        agent = await self.find_agent(request.agent_id)
        if bool(request.room_id) == bool(request.world_id):
            raise errors.MUTE_TARGET_INVALID("name exactly one of room_id and world_id")
        until = mute_until(request, datetime.now(UTC))
        state = "MUTED" if request.muted else None
        if request.room_id:
            room = uuid_of(request.room_id, "room_id")
            if not await self.admin.room_exists(agent.id, room):
                raise errors.ROOM_NOT_FOUND(f"agent {agent.character.name!r} has no room {room}")
            await self.store.set_room_state(agent.id, room, state, until)
        else:
            world = uuid_of(request.world_id, "world_id")
            if not await self.admin.set_world_mute(agent.id, world, state, until):
                raise errors.WORLD_NOT_FOUND(f"agent {agent.character.name!r} has no world {world}")
        return runtime_pb2.MuteState(
            agent_id=str(agent.id),
            room_id=request.room_id,
            world_id=request.world_id,
            muted=request.muted,
            until=timestamp(until),
        )


def mute_until(request: runtime_pb2.SetMuteRequest, now: datetime) -> datetime | None:
    """When a mute ends (None: until unmuted), from ``until`` or ``duration_seconds``."""
    has_until = request.HasField("until")
    duration = request.duration_seconds
    if not request.muted:
        if has_until or duration:
            raise errors.MUTE_TIME_INVALID("an unmute takes no until or duration_seconds")
        return None
    if has_until and duration:
        raise errors.MUTE_TIME_INVALID("give until or duration_seconds, not both")
    if has_until:
        until = datetime_of(request.until)
        if until is None or until <= now:
            raise errors.MUTE_TIME_INVALID("until must be in the future")
        if until - now > MAX_MUTE:
            raise errors.MUTE_TIME_INVALID("until must be within a year (mute for good without a time)")
        return until
    if duration:
        if not 0 < duration <= MAX_MUTE.total_seconds():  # also refuses NaN
            raise errors.MUTE_TIME_INVALID("duration_seconds must be above 0 and at most a year")
        return now + timedelta(seconds=duration)
    return None
