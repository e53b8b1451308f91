"""The storage of operator administration: the agent's rooms, worlds, entities, participants and
relationships as the operator reads them, roles the operator sets, and mutes of whole worlds."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Any

from parley_platform.postgres import Database

from .records import Row
from .store import Q


class AdminStore:
    def __init__(self, db: Database) -> None:
        self.db = db

    async def list_rooms_admin(
        self, agent_id: uuid.UUID, world_id: uuid.UUID | None, limit: int, offset: int
    ) -> Sequence[Row]:
        return await self.db.fetchall(
            Q["list_rooms_admin"],
            {"agent_id": agent_id, "world_id": world_id, "limit": limit, "offset": offset},
            what="list rooms",
            prepare=False,
        )

    async def list_worlds(self, agent_id: uuid.UUID, limit: int, offset: int) -> Sequence[Row]:
        return await self.db.fetchall(
            Q["list_worlds"], {"agent_id": agent_id, "limit": limit, "offset": offset}, what="list worlds"
        )

    async def list_entities(
        self, agent_id: uuid.UUID, room_id: uuid.UUID | None, limit: int, offset: int
    ) -> Sequence[Row]:
        return await self.db.fetchall(
            Q["list_entities"],
            {"agent_id": agent_id, "room_id": room_id, "limit": limit, "offset": offset},
            what="list entities",
            prepare=False,
        )

    async def list_participants(
        self,
        agent_id: uuid.UUID,
        room_id: uuid.UUID | None,
        entity_id: uuid.UUID | None,
        limit: int,
        offset: int,
    ) -> Sequence[Row]:
        return await self.db.fetchall(
            Q["list_participants"],
            {
                "agent_id": agent_id,
                "room_id": room_id,
                "entity_id": entity_id,
                "limit": limit,
                "offset": offset,
            },
            what="list participants",
            prepare=False,
        )

    async def list_relationships(
        self, agent_id: uuid.UUID, entity_id: uuid.UUID | None, tag: str | None, limit: int, offset: int
    ) -> Sequence[Row]:
        return await self.db.fetchall(
            Q["list_relationships"],
            {"agent_id": agent_id, "entity_id": entity_id, "tag": tag, "limit": limit, "offset": offset},
            what="list relationships",
            prepare=False,
        )

    async def set_participant_role(
        self, agent_id: uuid.UUID, room_id: uuid.UUID, entity_id: uuid.UUID, role: str
    ) -> Row | None:
        return await self.db.fetchone(
            Q["set_participant_role"],
            {"agent_id": agent_id, "room_id": room_id, "entity_id": entity_id, "role": role},
            what="set participant role",
        )

    async def room_exists(self, agent_id: uuid.UUID, room_id: uuid.UUID) -> bool:
        row = await self.db.fetchone(Q["room_exists"], {"agent_id": agent_id, "id": room_id}, what="room")
        return row is not None

    async def set_world_mute(
        self, agent_id: uuid.UUID, world_id: uuid.UUID, state: str | None, mute_until: Any = None
    ) -> bool:
        row = await self.db.fetchone(
            Q["set_world_mute"],
            {"agent_id": agent_id, "world_id": world_id, "state": state, "mute_until": mute_until},
            what="set world mute",
        )
        return row is not None
