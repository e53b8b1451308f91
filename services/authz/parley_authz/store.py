"""The authz storage: named queries over the ``authz`` schema, one call each."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

from parley_platform import codes
from parley_platform.errors import Conflict
from parley_platform.postgres import Database, Row, load_queries

from . import domain, errors

SQL_DIR = Path(__file__).parent / "sql"
MIGRATIONS_DIR = SQL_DIR / "migrations"
SCHEMA = "authz"
Q = load_queries(SQL_DIR / "queries.sql")


class AuthzStore:
    def __init__(self, db: Database) -> None:
        self.db = db

    async def _one(self, query: str, params: dict[str, Any]) -> Row | None:
        return await self.db.fetchone(Q[query], params, what=query.replace("_", " "))

    async def _all(self, query: str, params: dict[str, Any]) -> list[Row]:
        return await self.db.fetchall(Q[query], params, what=query.replace("_", " "))

    # ----- 1. tool-call decisions ---------------------------------------------

    async def put_pending(self, params: dict[str, Any]) -> Row | None:
        try:
            return await self._one("put_pending", params)
        except Conflict as exc:
            if not codes.ALREADY_EXISTS.matches(exc):
                raise
            # Not the primary key (that is ON CONFLICT DO NOTHING): the message's call slot.
            raise errors.TOOL_CALL_CONFLICT(
                "another tool call already has this message_id and call_index"
            ) from exc

    async def get_tool_call(self, agent_id: uuid.UUID, tool_call_id: str) -> Row | None:
        return await self._one("get_tool_call", {"agent_id": agent_id, "id": tool_call_id})

    async def decide(self, params: dict[str, Any]) -> Row | None:
        return await self._one("decide", params)

    async def settle(self, params: dict[str, Any]) -> Row | None:
        return await self._one("settle", params)

    async def list_pending(
        self, agent_id: uuid.UUID, conversation_id: str | None, limit: int, offset: int
    ) -> list[Row]:
        return await self._all(
            "list_pending_tool_calls",
            {"agent_id": agent_id, "conversation_id": conversation_id, "limit": limit, "offset": offset},
        )

    async def list_stuck(self, agent_id: uuid.UUID, older_than: float, limit: int, offset: int) -> list[Row]:
        return await self._all(
            "list_stuck_tool_calls",
            {"agent_id": agent_id, "older_than": older_than, "limit": limit, "offset": offset},
        )

    async def list_message(self, agent_id: uuid.UUID, conversation_id: str, message_id: str) -> list[Row]:
        return await self._all(
            "list_message_tool_calls",
            {"agent_id": agent_id, "conversation_id": conversation_id, "message_id": message_id},
        )

    async def expire_due(self, limit: int) -> list[Row]:
        return await self._all("expire_due_tool_calls", {"limit": limit})

    async def unannounced(self, grace: float, limit: int) -> list[Row]:
        return await self._all("unannounced_tool_calls", {"grace": grace, "limit": limit})

    async def mark_announced(self, rows: list[Row]) -> None:
        await self.db.execute(
            Q["mark_announced"],
            {
                "agent_ids": [row["agent_id"] for row in rows],
                "ids": [row["id"] for row in rows],
                "statuses": [row["status"] for row in rows],
            },
            what="mark announced",
        )

    async def gauges(self) -> list[Row]:
        return await self._all("gauges", {})

    # ----- 2. capability authorization ----------------------------------------

    async def put_account_snapshot(self, agent_id: uuid.UUID, account_id: str, version: str) -> Row:
        row = await self._one(
            "put_account_snapshot",
            {"agent_id": agent_id, "account_id": account_id, "snapshot_version": version},
        )
        assert row is not None
        return row

    async def revoke_account_snapshot(self, agent_id: uuid.UUID, account_id: str) -> bool:
        rows = await self._all("revoke_account_snapshot", {"agent_id": agent_id, "account_id": account_id})
        return bool(rows)

    async def register_decision(self, params: dict[str, Any]) -> Row:
        row = await self._one("register_decision", params)
        assert row is not None
        return row

    async def issue_confirmation(self, params: dict[str, Any]) -> bool:
        return await self._one("issue_confirmation", params) is not None

    async def confirmation_seen(self, agent_id: uuid.UUID, confirmation_id: str) -> Row | None:
        return await self._one(
            "confirmation_seen", {"agent_id": agent_id, "confirmation_id": confirmation_id}
        )

    async def authorize(self, params: dict[str, Any]) -> Row:
        row = await self._one("authorize", params)
        assert row is not None
        return row

    async def record_receipt(self, params: dict[str, Any]) -> Row:
        row = await self._one("record_receipt", params)
        assert row is not None
        return row

    # ----- 3. interaction leases ----------------------------------------------

    async def acquire_lease(self, params: dict[str, Any]) -> Row | None:
        try:
            return await self._one("acquire_lease", params)
        except Conflict as exc:
            if not codes.ALREADY_EXISTS.matches(exc):
                raise
            # The resource is ON CONFLICT; what else is unique is the lease id.
            raise domain.lease_conflict("lease_id is already bound to another resource") from exc

    async def lease_of_resource(self, agent_id: uuid.UUID, kind: str, resource_id: str) -> Row | None:
        return await self._one(
            "lease_of_resource", {"agent_id": agent_id, "resource_kind": kind, "resource_id": resource_id}
        )

    async def renew_lease(self, params: dict[str, Any]) -> Row | None:
        return await self._one("renew_lease", params)

    async def release_lease(self, params: dict[str, Any]) -> Row:
        row = await self._one("release_lease", params)
        assert row is not None
        return row

    async def leases_by_id(self, agent_id: uuid.UUID, lease_ids: list[str]) -> list[Row]:
        return await self._all("leases_by_id", {"agent_id": agent_id, "lease_ids": lease_ids})

    async def list_leases(
        self, agent_id: uuid.UUID, include_expired: bool, limit: int, offset: int
    ) -> list[Row]:
        return await self._all(
            "list_leases",
            {"agent_id": agent_id, "include_expired": include_expired, "limit": limit, "offset": offset},
        )

    # ----- 4. interaction confirmations ---------------------------------------

    async def register_interaction(self, params: dict[str, Any]) -> Row | None:
        return await self._one("register_interaction_confirmation", params)

    async def issue_interaction(self, params: dict[str, Any]) -> Row | None:
        return await self._one("issue_interaction_confirmation", params)

    async def get_interaction(self, agent_id: uuid.UUID, confirmation_id: str) -> Row | None:
        return await self._one(
            "get_interaction_confirmation", {"agent_id": agent_id, "confirmation_id": confirmation_id}
        )

    async def consume_interaction(self, params: dict[str, Any]) -> Row:
        row = await self._one("consume_interaction_confirmation", params)
        assert row is not None
        return row
