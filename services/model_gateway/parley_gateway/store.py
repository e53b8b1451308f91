"""The gateway's storage: named queries over the ``model`` schema."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from psycopg.types.json import Jsonb

from parley_platform.postgres import Database, load_queries

from .batching import Section
from .records import AffinityStatus, Budget, DrainClaim, Reservation, UsageIncrement, UsageTotal

SQL_DIR = Path(__file__).parent / "sql"
MIGRATIONS_DIR = SQL_DIR / "migrations"
SCHEMA = "model"
Q = load_queries(SQL_DIR / "queries.sql")


class GatewayStore:
    def __init__(self, db: Database) -> None:
        self.db = db

    # --- budgets -------------------------------------------------------------------------------

    async def reserve(self, agent_id: str, tokens: int) -> Reservation:
        row = await self.db.fetchone(
            Q["reserve_budget"], {"agent_id": agent_id, "tokens": tokens}, what="reserve budget"
        )
        assert row is not None
        return Reservation.from_row(row)

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

    async def set_budget(self, agent_id: str, limit_tokens: int, window_seconds: int) -> Budget:
        row = await self.db.fetchone(
            Q["set_budget"],
            {"agent_id": agent_id, "limit_tokens": limit_tokens, "window_seconds": window_seconds},
            what="set budget",
        )
        assert row is not None
        return Budget.from_row(row)

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

    async def get_budget(self, agent_id: str) -> Budget | None:
        row = await self.db.fetchone(Q["get_budget"], {"agent_id": agent_id}, what="get budget")
        return None if row is None else Budget.from_row(row)

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

    async def list_usage(self, agent_id: str, limit: int, offset: int) -> list[UsageTotal]:
        rows = await self.db.fetchall(
            Q["list_usage"], {"agent_id": agent_id, "limit": limit, "offset": offset}, what="list usage"
        )
        return [UsageTotal.from_row(row) for row in rows]

    # --- batcher ---------------------------------------------------------------------------------

    async def add_section(self, section: Section) -> bool:
        row = await self.db.fetchone(
            Q["add_section"],
            {
                "agent_id": section.agent_id,
                "id": section.id,
                "affinity": section.affinity,
                "spec": Jsonb(section.to_spec()),
                "frequency": section.frequency,
                "min_cycle_ms": section.min_cycle_ms,
                "owner": section.owner,
            },
            what="add section",
        )
        return row is not None

    async def claim_drain(self, affinity: str, holder: str, lease_seconds: float) -> DrainClaim | None:
        """The affinity's drain lease and its due sections, or None while a live drain holds it."""
        row = await self.db.fetchone(
            Q["claim_drain"],
            {"affinity": affinity, "holder": holder, "lease_seconds": lease_seconds},
            what="claim drain",
        )
        if row is None:
            return None
        return DrainClaim(
            row["seq"], row["started_at"], tuple(Section.from_spec(spec) for spec in row["specs"])
        )

    async def finish_drain(
        self,
        affinity: str,
        claim: DrainClaim,
        results: list[tuple[str, str, dict[str, Any]]],
        *,
        calls: int,
    ) -> tuple[int, bool]:
        """Store the drain's results (agent, section id, result) and give its lease back: how many
        sections it finished, and whether it still held the lease."""
        row = await self.db.fetchone(
            Q["finish_drain"],
            {
                "affinity": affinity,
                "seq": claim.seq,
                "started_at": claim.started_at,
                "sections": len(claim.sections),
                "calls": calls,
                "agent_ids": [agent for agent, _, _ in results],
                "ids": [section for _, section, _ in results],
                "results": [Jsonb(result) for _, _, result in results],
            },
            what="finish drain",
        )
        assert row is not None
        return int(row["finished"]), bool(row["released"])

    async def dispose_sections(self, agent_id: str, ids: list[str], owner: str) -> int:
        rows = await self.db.fetchall(
            Q["dispose_sections"], {"agent_id": agent_id, "ids": ids, "owner": owner}, what="dispose sections"
        )
        return len(rows)

    async def batcher_status(self, affinity: str) -> list[AffinityStatus]:
        rows = await self.db.fetchall(Q["batcher_status"], {"affinity": affinity}, what="batcher status")
        return [AffinityStatus.from_row(row) for row in rows]
