"""The gateway's storage: named queries over the ``model`` schema."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from psycopg.types.json import Jsonb

from parley_platform.postgres import Database, Row, load_queries

SQL_DIR = Path(__file__).parent / "sql"
MIGRATIONS_DIR = SQL_DIR / "migrations"
SCHEMA = "model"
Q = load_queries(SQL_DIR / "queries.sql")


@dataclass(frozen=True)
class Reservation:
    budgeted: bool
    admitted: bool
    limit_tokens: int | None


@dataclass(frozen=True)
class UsageIncrement:
    agent_id: str
    provider: str
    model: str
    model_type: str
    kind: str
    requests: int
    input_tokens: int
    output_tokens: int
    cached_input_tokens: int


class GatewayStore:
    def __init__(self, db: Database) -> None:
        self.db = db

    # --- budgets -------------------------------------------------------------------------------

    async def reserve(self, agent_id: str, tokens: int) -> Reservation:
        row = await self.db.fetchone(
            Q["reserve_budget"], {"agent_id": agent_id, "tokens": tokens}, what="reserve budget"
        )
        assert row is not None
        return Reservation(bool(row["budgeted"]), bool(row["admitted"]), row["limit_tokens"])

    async def commit(self, agent_id: str, reserved: int, used: int) -> bool:
        row = await self.db.fetchone(
            Q["commit_budget"],
            {"agent_id": agent_id, "reserved": reserved, "used": used},
            what="commit budget",
        )
        return row is not None

    async def release(self, agent_id: str, reserved: int) -> bool:
        row = await self.db.fetchone(
            Q["release_budget"], {"agent_id": agent_id, "reserved": reserved}, what="release budget"
        )
        return row is not None

    async def set_budget(self, agent_id: str, limit_tokens: int, window_seconds: int) -> Row:
        row = await self.db.fetchone(
            Q["set_budget"],
            {"agent_id": agent_id, "limit_tokens": limit_tokens, "window_seconds": window_seconds},
            what="set budget",
        )
        assert row is not None
        return row

    async def ensure_budget(self, agent_id: str, limit_tokens: int, window_seconds: int) -> None:
        await self.db.execute(
            Q["ensure_budget"],
            {"agent_id": agent_id, "limit_tokens": limit_tokens, "window_seconds": window_seconds},
            what="ensure budget",
        )

    async def delete_budget(self, agent_id: str) -> bool:
        return (
            await self.db.fetchone(Q["delete_budget"], {"agent_id": agent_id}, what="delete budget")
            is not None
        )

    async def get_budget(self, agent_id: str) -> Row | None:
        return await self.db.fetchone(Q["get_budget"], {"agent_id": agent_id}, what="get budget")

    # --- the usage ledger ----------------------------------------------------------------------

    async def record_usage(self, rows: list[UsageIncrement]) -> None:
        if not rows:
            return
        await self.db.execute(
            Q["record_usage"],
            {
                "agent_ids": [r.agent_id for r in rows],
                "providers": [r.provider for r in rows],
                "models": [r.model for r in rows],
                "model_types": [r.model_type for r in rows],
                "kinds": [r.kind for r in rows],
                "requests": [r.requests for r in rows],
                "input_tokens": [r.input_tokens for r in rows],
                "output_tokens": [r.output_tokens for r in rows],
                "cached": [r.cached_input_tokens for r in rows],
            },
            what="record usage",
        )

    async def list_usage(self, agent_id: str, limit: int, offset: int) -> list[Row]:
        return await self.db.fetchall(
            Q["list_usage"], {"agent_id": agent_id, "limit": limit, "offset": offset}, what="list usage"
        )

    # --- batcher ---------------------------------------------------------------------------------

    async def add_section(
        self,
        *,
        agent_id: str,
        id: str,
        affinity: str,
        spec: dict[str, Any],
        frequency: str,
        min_cycle_ms: int,
        owner: str,
    ) -> bool:
        row = await self.db.fetchone(
            Q["add_section"],
            {
                "agent_id": agent_id,
                "id": id,
                "affinity": affinity,
                "spec": Jsonb(spec),
                "frequency": frequency,
                "min_cycle_ms": min_cycle_ms,
                "owner": owner,
            },
            what="add section",
        )
        return row is not None

    async def claim_affinity(
        self, affinity: str, holder: str, lease_seconds: float
    ) -> tuple[int, datetime] | None:
        row = await self.db.fetchone(
            Q["claim_affinity"],
            {"affinity": affinity, "holder": holder, "lease_seconds": lease_seconds},
            what="claim drain",
        )
        return None if row is None else (int(row["drain_seq"]), row["started_at"])

    async def claim_sections(self, affinity: str, seq: int) -> list[Row]:
        return await self.db.fetchall(
            Q["claim_sections"], {"affinity": affinity, "seq": seq}, what="claim sections"
        )

    async def finish_sections(self, seq: int, results: list[tuple[str, str, dict[str, Any]]]) -> int:
        if not results:
            return 0
        rows = await self.db.fetchall(
            Q["finish_sections"],
            {
                "seq": seq,
                "agent_ids": [agent for agent, _, _ in results],
                "ids": [section for _, section, _ in results],
                "results": [Jsonb(result) for _, _, result in results],
            },
            what="finish sections",
        )
        return len(rows)

    async def release_affinity(
        self, affinity: str, seq: int, started_at: datetime, sections: int, calls: int
    ) -> bool:
        row = await self.db.fetchone(
            Q["release_affinity"],
            {
                "affinity": affinity,
                "seq": seq,
                "started_at": started_at,
                "sections": sections,
                "calls": calls,
            },
            what="release drain",
        )
        return row is not None

    async def dispose_sections(self, agent_id: str, ids: list[str], owner: str) -> int:
        rows = await self.db.fetchall(
            Q["dispose_sections"], {"agent_id": agent_id, "ids": ids, "owner": owner}, what="dispose sections"
        )
        return len(rows)

    async def batcher_status(self, affinity: str) -> list[Row]:
        return await self.db.fetchall(Q["batcher_status"], {"affinity": affinity}, what="batcher status")
