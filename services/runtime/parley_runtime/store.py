"""The runtime's storage: named queries over the ``runtime`` schema."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from psycopg.types.json import Jsonb

from parley_platform.postgres import Database, Row, load_queries

SQL_DIR = Path(__file__).parent / "sql"
MIGRATIONS_DIR = SQL_DIR / "migrations"
SCHEMA = "runtime"
Q = load_queries(SQL_DIR / "queries.sql")


@dataclass(frozen=True)
class Ingested:
    state: str | None  # the turn's state after ingest; None when it had already finished
    previous_state: str | None  # None for a message seen for the first time
    previous_response_id: uuid.UUID | None
    attempts: int
    lease_token: int | None
    history: list[dict[str, Any]]  # the room's recent messages, oldest first


class RuntimeStore:
    def __init__(self, db: Database) -> None:
        self.db = db

    async def upsert_agent(
        self, agent_id: uuid.UUID, name: str, character: dict[str, Any], enabled: bool
    ) -> None:
        await self.db.execute(
            Q["upsert_agent"],
            {"id": agent_id, "name": name, "character": Jsonb(character), "enabled": enabled},
            what="upsert agent",
        )

    async def list_agents(self, limit: int, offset: int) -> list[Row]:
        return await self.db.fetchall(
            Q["list_agents"], {"limit": limit, "offset": offset}, what="list agents"
        )

    async def ingest(self, params: dict[str, Any]) -> Ingested:
        row = await self.db.fetchone(Q["ingest"], params, what="ingest message")
        assert row is not None
        return Ingested(
            state=row["state"],
            previous_state=row["previous_state"],
            previous_response_id=row["previous_response_id"],
            attempts=row["attempts"] or 0,
            lease_token=row["lease_token"],
            history=row["history"],
        )

    async def save_reply(
        self,
        *,
        agent_id: uuid.UUID,
        room_id: uuid.UUID,
        turn_id: uuid.UUID,
        lease_token: int,
        response_id: uuid.UUID,
        content: dict[str, Any],
        source: str,
        trajectory: dict[str, Any] | None,
    ) -> str | None:
        row = await self.db.fetchone(
            Q["save_reply"],
            {
                "agent_id": agent_id,
                "room_id": room_id,
                "turn_id": turn_id,
                "lease_token": lease_token,
                "response_id": response_id,
                "content": Jsonb(content),
                "source": source,
                "trajectory": Jsonb(trajectory) if trajectory is not None else None,
            },
            what="save reply",
        )
        return None if row is None else str(row["state"])

    async def finish_turn(
        self,
        agent_id: uuid.UUID,
        turn_id: uuid.UUID,
        state: str,
        *,
        lease_token: int | None,
        error: str | None = None,
    ) -> bool:
        row = await self.db.fetchone(
            Q["finish_turn"],
            {
                "agent_id": agent_id,
                "turn_id": turn_id,
                "state": state,
                "error": error,
                "lease_token": lease_token,
            },
            what="finish turn",
        )
        return row is not None

    async def get_memory(self, agent_id: uuid.UUID, memory_id: uuid.UUID) -> Row | None:
        return await self.db.fetchone(
            Q["get_memory"], {"agent_id": agent_id, "id": memory_id}, what="get memory"
        )

    async def get_room(self, agent_id: uuid.UUID, room_id: uuid.UUID) -> Row | None:
        return await self.db.fetchone(Q["get_room"], {"agent_id": agent_id, "id": room_id}, what="get room")

    async def list_rooms(self, agent_id: uuid.UUID, limit: int, offset: int) -> list[Row]:
        return await self.db.fetchall(
            Q["list_rooms"], {"agent_id": agent_id, "limit": limit, "offset": offset}, what="list rooms"
        )

    async def list_memories(
        self, agent_id: uuid.UUID, kind: str, room_id: uuid.UUID | None, limit: int, offset: int
    ) -> list[Row]:
        return await self.db.fetchall(
            Q["list_memories"],
            {"agent_id": agent_id, "kind": kind, "room_id": room_id, "limit": limit, "offset": offset},
            what="list memories",
        )

    async def list_turns(
        self, agent_id: uuid.UUID, room_id: uuid.UUID | None, limit: int, offset: int
    ) -> list[Row]:
        return await self.db.fetchall(
            Q["list_turns"],
            {"agent_id": agent_id, "room_id": room_id, "limit": limit, "offset": offset},
            what="list turns",
        )
