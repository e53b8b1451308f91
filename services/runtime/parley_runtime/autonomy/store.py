"""Autonomy's rows: the operator's switch per agent, and its autonomous turns (named queries)."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import datetime

from parley_platform.postgres import Database

from ..store import Q


@dataclass(frozen=True)
class Switch:
    enabled: bool
    generation: int
    updated_at: datetime


@dataclass(frozen=True)
class Counts:
    turns: int
    last_at: datetime | None


class AutonomyStore:
    def __init__(self, db: Database) -> None:
        self.db = db

    async def switch(self, agent_id: uuid.UUID) -> Switch | None:
        row = await self.db.fetchone(Q["get_autonomy"], {"agent_id": agent_id}, what="get autonomy")
        return None if row is None else Switch(row["enabled"], row["generation"], row["updated_at"])

    async def set_switch(self, agent_id: uuid.UUID, enabled: bool) -> Switch:
        row = await self.db.fetchone(
            Q["set_autonomy"], {"agent_id": agent_id, "enabled": enabled}, what="set autonomy"
        )
        assert row is not None
        return Switch(row["enabled"], row["generation"], row["updated_at"])

    async def busy(self, agent_id: uuid.UUID, stale_seconds: float) -> bool:
        """An autonomous turn of the agent is still running (one a dead replica left is stale)."""
        row = await self.db.fetchone(
            Q["autonomy_busy"], {"agent_id": agent_id, "stale_seconds": stale_seconds}, what="autonomy busy"
        )
        return bool(row and row["busy"])

    async def counts(self, agent_id: uuid.UUID) -> Counts:
        row = await self.db.fetchone(Q["autonomy_counts"], {"agent_id": agent_id}, what="autonomy counts")
        return Counts(int(row["turns"]), row["last_at"]) if row else Counts(0, None)
