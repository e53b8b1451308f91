"""The authz storage: named queries over the ``authz`` schema, one statement each, typed records out.

Each state change is one statement naming the state it expects (see sql/queries.sql); the
record it returns, or what it saw instead, comes back as a record of ``model``.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

from parley_platform import codes
from parley_platform.errors import Conflict
from parley_platform.postgres import Database, Row, load_queries

from . import errors
from .model import (
    Authorization,
    AuthorizationAttempt,
    AuthorizeOutcome,
    BoundRequest,
    CheckedDecision,
    CheckedReceipt,
    ConfirmationGrant,
    ConfirmationSeen,
    Consumption,
    ExistingReceipt,
    Gauge,
    Holder,
    InteractionConfirmation,
    Lease,
    Proposal,
    ReceiptOutcome,
    Registration,
    Release,
    SeenDecision,
    SeenInteraction,
    Settlement,
    SnapshotPut,
    ToolCall,
    Verdict,
    field_names,
)

SQL_DIR = Path(__file__).parent / "sql"
MIGRATIONS_DIR = SQL_DIR / "migrations"
SCHEMA = "authz"
Q = load_queries(SQL_DIR / "queries.sql")


def params(record: Any) -> dict[str, Any]:
    """A record's fields as the named parameters of a query (shallow, unlike ``asdict``)."""
    return {name: getattr(record, name) for name in field_names(type(record))}


class AuthzStore:
    def __init__(self, db: Database) -> None:
        self.db = db

    async def _one(self, query: str, values: dict[str, Any], *, grouped: bool = False) -> Row | None:
        """``grouped``: a compare-and-swap that concurrent callers' statements may commit together
        (``Database.fetchone_grouped``); each caller still gets what its statement alone gives."""
        fetch = self.db.fetchone_grouped if grouped else self.db.fetchone
        return await fetch(Q[query], values, what=query.replace("_", " "))

    async def _the_one(self, query: str, values: dict[str, Any], *, grouped: bool = False) -> Row:
        """A statement that always answers one row (it reports what it did or saw)."""
        row = await self._one(query, values, grouped=grouped)
        assert row is not None, query
        return row

    async def _all(self, query: str, values: dict[str, Any]) -> list[Row]:
        return await self.db.fetchall(Q[query], values, what=query.replace("_", " "))

    async def _calls(self, query: str, values: dict[str, Any]) -> list[ToolCall]:
        return [ToolCall.from_row(row) for row in await self._all(query, values)]

    async def _call(self, query: str, values: dict[str, Any], *, grouped: bool = False) -> ToolCall | None:
        row = await self._one(query, values, grouped=grouped)
        return None if row is None else ToolCall.from_row(row)

    # ----- 1. tool-call decisions ---------------------------------------------

    async def put_pending(self, proposal: Proposal) -> tuple[ToolCall, bool] | None:
        """The call and whether this statement created it; None only while a concurrent first
        insert of the same call commits."""
        try:
            row = await self._one("put_pending", params(proposal))
        except Conflict as exc:
            if not codes.ALREADY_EXISTS.matches(exc):
                raise
            # Not the primary key (that is ON CONFLICT DO NOTHING): the message's call slot.
            raise errors.TOOL_CALL_CONFLICT(
                "another tool call already has this message_id and call_index"
            ) from exc
        return None if row is None else (ToolCall.from_row(row), row["created"])

    async def get_tool_call(self, agent_id: uuid.UUID, tool_call_id: str) -> ToolCall | None:
        return await self._call("get_tool_call", {"agent_id": agent_id, "id": tool_call_id})

    async def decide(self, verdict: Verdict) -> ToolCall | None:
        """pending -> claimed (approve) or settled (deny); None when the call was not pending."""
        return await self._call("decide", params(verdict), grouped=True)

    async def settle(self, settlement: Settlement) -> ToolCall | None:
        """claimed -> settled with the claim's own token; None otherwise."""
        return await self._call("settle", params(settlement))

    async def list_pending(
        self, agent_id: uuid.UUID, conversation_id: str | None, limit: int, offset: int
    ) -> list[ToolCall]:
        return await self._calls(
            "list_pending_tool_calls",
            {"agent_id": agent_id, "conversation_id": conversation_id, "limit": limit, "offset": offset},
        )

    async def list_stuck(
        self, agent_id: uuid.UUID, older_than: float, limit: int, offset: int
    ) -> list[ToolCall]:
        return await self._calls(
            "list_stuck_tool_calls",
            {"agent_id": agent_id, "older_than": older_than, "limit": limit, "offset": offset},
        )

    async def list_message(
        self, agent_id: uuid.UUID, conversation_id: str, message_id: str
    ) -> list[ToolCall]:
        return await self._calls(
            "list_message_tool_calls",
            {"agent_id": agent_id, "conversation_id": conversation_id, "message_id": message_id},
        )

    async def expire_due(self, limit: int) -> list[ToolCall]:
        return await self._calls("expire_due_tool_calls", {"limit": limit})

    async def unannounced(self, grace: float, limit: int) -> list[ToolCall]:
        return await self._calls("unannounced_tool_calls", {"grace": grace, "limit": limit})

    async def mark_announced(self, calls: list[ToolCall]) -> None:
        await self.db.execute(
            Q["mark_announced"],
            {
                "agent_ids": [call.agent_id for call in calls],
                "ids": [call.id for call in calls],
                "statuses": [call.status for call in calls],
            },
            what="mark announced",
        )

    async def gauges(self) -> list[Gauge]:
        return [Gauge.from_row(row) for row in await self._all("gauges", {})]

    # ----- 2. capability authorization ----------------------------------------

    async def put_account_snapshot(self, agent_id: uuid.UUID, account_id: str, version: str) -> SnapshotPut:
        values = {"agent_id": agent_id, "account_id": account_id, "snapshot_version": version}
        return SnapshotPut.from_row(await self._the_one("put_account_snapshot", values))

    async def revoke_account_snapshot(self, agent_id: uuid.UUID, account_id: str) -> bool:
        rows = await self._all("revoke_account_snapshot", {"agent_id": agent_id, "account_id": account_id})
        return bool(rows)

    async def register_decision(self, request: BoundRequest, decision: CheckedDecision) -> Registration:
        values = {
            "agent_id": request.agent_id,
            "decision_id": decision.decision_id,
            "confirmation_id": decision.confirmation_id,
            "id_count": decision.id_count,
            "decision_digest": decision.digest,
            "request_digest": request.digest,
            "outcome": decision.outcome,
            "account_id": request.account_id,
            "snapshot_version": request.snapshot_version,
            "capability": request.capability,
            "operation": request.operation,
            "risk": request.risk,
            "input_digest": request.input_digest,
            "issued_at": decision.issued_at,
            "expires_at": decision.expires_at,
        }
        return Registration.from_row(await self._the_one("register_decision", values))

    async def issue_confirmation(self, grant: ConfirmationGrant, issued_by: str) -> bool:
        """pending -> issued for that decision while it is live; False when nothing changed."""
        values = {**params(grant), "grant_digest": grant.digest, "issued_by": issued_by}
        return await self._one("issue_confirmation", values) is not None

    async def confirmation_seen(self, agent_id: uuid.UUID, confirmation_id: str) -> ConfirmationSeen | None:
        row = await self._one("confirmation_seen", {"agent_id": agent_id, "confirmation_id": confirmation_id})
        return None if row is None else ConfirmationSeen.from_row(row)

    async def authorize(self, attempt: AuthorizationAttempt) -> AuthorizeOutcome:
        row = await self._the_one("authorize", params(attempt), grouped=True)
        return AuthorizeOutcome(
            authorization=None if row["id"] is None else Authorization.from_row(row),
            deleted=row["deleted"],
            deleted_current=row["deleted_current"],
            # request_digest is NOT NULL: none seen is no live decision with that id.
            seen=None if row["seen_request_digest"] is None else SeenDecision.from_row(row, "seen_"),
            known=row["known"],
        )

    async def sweep_expired_decisions(self, retention_seconds: float, limit: int) -> int:
        """Deletes up to ``limit`` decisions expired more than ``retention_seconds`` ago (burning
        their confirmations); returns how many."""
        row = await self._the_one(
            "sweep_expired_decisions", {"retention_seconds": retention_seconds, "limit": limit}
        )
        swept: int = row["swept"]
        return swept

    async def record_receipt(self, agent_id: uuid.UUID, receipt: CheckedReceipt) -> ReceiptOutcome:
        values = {**params(receipt), "agent_id": agent_id, "receipt_digest": receipt.digest}
        row = await self._the_one("record_receipt", values)
        return ReceiptOutcome(
            recorded_at=row["recorded_at"],
            db_now=row["db_now"],
            authorization=Authorization.from_row(row) if row["authorization_exists"] else None,
            existing=None if row["existing_digest"] is None else ExistingReceipt.from_row(row, "existing_"),
        )

    # ----- 3. interaction leases ----------------------------------------------

    async def acquire_lease(self, holder: Holder, kind: str, resource_id: str, ttl_ms: int) -> Lease | None:
        """The lease granted (the resource was free, or its lease expired); None while a live one holds it."""
        values = {**params(holder), "resource_kind": kind, "resource_id": resource_id, "ttl_ms": ttl_ms}
        try:
            row = await self._one("acquire_lease", values)
        except Conflict as exc:
            if not codes.ALREADY_EXISTS.matches(exc):
                raise
            # The resource is ON CONFLICT; what else is unique is the lease id.
            raise errors.LEASE_CONFLICT("lease_id is already bound to another resource") from exc
        return None if row is None else Lease.from_row(row)

    async def lease_of_resource(self, agent_id: uuid.UUID, kind: str, resource_id: str) -> Lease | None:
        row = await self._one(
            "lease_of_resource", {"agent_id": agent_id, "resource_kind": kind, "resource_id": resource_id}
        )
        return None if row is None else Lease.from_row(row)

    async def renew_lease(self, holder: Holder, ttl_ms: int) -> Lease | None:
        row = await self._one("renew_lease", {**params(holder), "ttl_ms": ttl_ms})
        return None if row is None else Lease.from_row(row)

    async def release_lease(self, holder: Holder) -> Release:
        return Release.from_row(await self._the_one("release_lease", params(holder)))

    async def leases_by_id(self, agent_id: uuid.UUID, lease_ids: list[str]) -> list[Lease]:
        rows = await self._all("leases_by_id", {"agent_id": agent_id, "lease_ids": lease_ids})
        return [Lease.from_row(row) for row in rows]

    async def list_leases(
        self, agent_id: uuid.UUID, include_expired: bool, limit: int, offset: int
    ) -> list[Lease]:
        rows = await self._all(
            "list_leases",
            {"agent_id": agent_id, "include_expired": include_expired, "limit": limit, "offset": offset},
        )
        return [Lease.from_row(row) for row in rows]

    # ----- 4. interaction confirmations ---------------------------------------

    async def register_interaction(
        self, agent_id: uuid.UUID, confirmation_id: str, action_digest: str, ttl_ms: int
    ) -> tuple[InteractionConfirmation, bool] | None:
        """The confirmation and whether this statement created it; None only while a concurrent
        registration of the same id commits."""
        row = await self._one(
            "register_interaction_confirmation",
            {
                "agent_id": agent_id,
                "confirmation_id": confirmation_id,
                "action_digest": action_digest,
                "ttl_ms": ttl_ms,
            },
        )
        return None if row is None else (InteractionConfirmation.from_row(row), row["created"])

    async def issue_interaction(
        self, agent_id: uuid.UUID, confirmation_id: str, action_digest: str, grant_id: str
    ) -> InteractionConfirmation | None:
        """pending -> issued, for that action while live; None when nothing changed."""
        row = await self._one(
            "issue_interaction_confirmation",
            {
                "agent_id": agent_id,
                "confirmation_id": confirmation_id,
                "action_digest": action_digest,
                "grant_id": grant_id,
            },
        )
        return None if row is None else InteractionConfirmation.from_row(row)

    async def get_interaction(
        self, agent_id: uuid.UUID, confirmation_id: str
    ) -> InteractionConfirmation | None:
        row = await self._one(
            "get_interaction_confirmation", {"agent_id": agent_id, "confirmation_id": confirmation_id}
        )
        return None if row is None else InteractionConfirmation.from_row(row)

    async def consume_interaction(
        self, agent_id: uuid.UUID, confirmation_id: str, grant_id: str, action_digest: str
    ) -> Consumption:
        """issued -> consumed, once, with its grant and action; what it saw when nothing changed."""
        row = await self._the_one(
            "consume_interaction_confirmation",
            {
                "agent_id": agent_id,
                "confirmation_id": confirmation_id,
                "grant_id": grant_id,
                "action_digest": action_digest,
            },
        )
        return Consumption(
            consumed=None if row["state"] is None else InteractionConfirmation.from_row(row),
            seen=None if row["seen_state"] is None else SeenInteraction.from_row(row, "seen_"),
        )
