"""The pairing service's storage: named queries over the ``pairing`` schema, rows to domain types."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

from psycopg.types.json import Jsonb

from parley_platform.paging import Page
from parley_platform.postgres import Database, Row, load_queries

from . import errors
from .connectors import Connector
from .domain import (
    AllowEntry,
    EntryListing,
    PendingRequest,
    RequestListing,
    Upserted,
    UpsertOutcome,
    new_code,
)

SQL_DIR = Path(__file__).parent / "sql"
MIGRATIONS_DIR = SQL_DIR / "migrations"
SCHEMA = "pairing"
Q = load_queries(SQL_DIR / "queries.sql")
# Attempts of a statement that lost a race it can win by running again (see upsert_request).
_EXTRA_ATTEMPTS = 5


class PairingStore:
    def __init__(self, db: Database, *, ttl_seconds: float, max_pending: int) -> None:
        self.db = db
        self.ttl_seconds = ttl_seconds
        self.ttl = timedelta(seconds=ttl_seconds)
        self.max_pending = max_pending

    def _request_from_row(
        self, agent_id: uuid.UUID, channel: str, sender_id: str, row: Row
    ) -> PendingRequest:
        """A request from its row, which holds only what the statement's parameters do not."""
        return PendingRequest(
            id=row["id"],
            agent_id=agent_id,
            channel=channel,
            sender_id=sender_id,
            code=row["code"],
            created_at=row["created_at"],
            last_seen_at=row["last_seen_at"],
            expires_at=row["created_at"] + self.ttl,
            metadata=row["metadata"],
        )

    async def upsert_request(
        self, agent_id: uuid.UUID, channel: str, sender_id: str, metadata: dict[str, str]
    ) -> Upserted:
        params: dict[str, Any] = {
            "agent_id": agent_id,
            "channel": channel,
            "sender_id": sender_id,
            "metadata": Jsonb(metadata),
            "ttl": self.ttl_seconds,
            "max_pending": self.max_pending,
        }
        # Each lost race means another statement took a slot (or this sender's
        # row): at most max_pending of those before the channel is full.
        for _ in range(self.max_pending + _EXTRA_ATTEMPTS):
            params["code"] = new_code()
            row = await self.db.fetchone(Q["upsert_request"], params, what="upsert pairing request")
            assert row is not None
            if row["outcome"] == UpsertOutcome.FULL:
                return Upserted(UpsertOutcome.FULL, None)
            if row["outcome"] != "raced":
                request = self._request_from_row(agent_id, channel, sender_id, row)
                return Upserted(UpsertOutcome(row["outcome"]), request)
        raise errors.UPSERT_CONTENDED("upsert pairing request: lost every race for a slot")

    async def approve_code(
        self, agent_id: uuid.UUID, channel: str, code: str, added_by: str
    ) -> tuple[PendingRequest, AllowEntry] | None:
        row = await self.db.fetchone(
            Q["approve_code"],
            {
                "agent_id": agent_id,
                "channel": channel,
                "code": code,
                "added_by": added_by,
                "ttl": self.ttl_seconds,
            },
            what="approve pairing code",
        )
        if row is None:
            return None
        entry = AllowEntry(
            id=row["entry_id"],
            agent_id=agent_id,
            channel=channel,
            sender_id=row["sender_id"],
            created_at=row["entry_created_at"],
            added_by=row["entry_added_by"],
            metadata=row["entry_metadata"],
        )
        return self._request_from_row(agent_id, channel, row["sender_id"], row), entry

    async def deny_code(self, agent_id: uuid.UUID, channel: str, code: str) -> PendingRequest | None:
        row = await self.db.fetchone(
            Q["deny_code"],
            {"agent_id": agent_id, "channel": channel, "code": code, "ttl": self.ttl_seconds},
            what="deny pairing code",
        )
        return None if row is None else self._request_from_row(agent_id, channel, row["sender_id"], row)

    async def is_allowed(self, agent_id: uuid.UUID, channel: str, sender_id: str) -> bool:
        row = await self.db.fetchone(
            Q["is_allowed"],
            {"agent_id": agent_id, "channel": channel, "sender_id": sender_id},
            what="check allowlist",
        )
        return bool(row and row["allowed"])

    async def add_to_allowlist(
        self, agent_id: uuid.UUID, channel: str, sender_id: str, added_by: str, metadata: dict[str, str]
    ) -> tuple[bool, AllowEntry]:
        params = {
            "agent_id": agent_id,
            "channel": channel,
            "sender_id": sender_id,
            "added_by": added_by,
            "metadata": Jsonb(metadata),
        }
        for _ in range(_EXTRA_ATTEMPTS):
            row = await self.db.fetchone(Q["add_to_allowlist"], params, what="add to allowlist")
            # No row: a concurrent statement added this sender after our snapshot; now it is visible.
            if row is not None:
                return row["created"], self._entry_from_row(agent_id, channel, sender_id, row)
        raise errors.ALLOWLIST_CONTENDED("add to allowlist: contended")

    def _entry_from_row(self, agent_id: uuid.UUID, channel: str, sender_id: str, row: Row) -> AllowEntry:
        return AllowEntry(
            id=row["id"],
            agent_id=agent_id,
            channel=channel,
            sender_id=sender_id,
            created_at=row["created_at"],
            added_by=row["added_by"],
            metadata=row["metadata"],
        )

    async def remove_from_allowlist(self, agent_id: uuid.UUID, channel: str, sender_id: str) -> bool:
        row = await self.db.fetchone(
            Q["remove_from_allowlist"],
            {"agent_id": agent_id, "channel": channel, "sender_id": sender_id},
            what="remove from allowlist",
        )
        return row is not None

    async def claim_reply(self, agent_id: uuid.UUID, channel: str, sender_id: str) -> tuple[bool, str | None]:
        row = await self.db.fetchone(
            Q["claim_reply"],
            {"agent_id": agent_id, "channel": channel, "sender_id": sender_id, "ttl": self.ttl_seconds},
            what="claim pairing reply",
        )
        assert row is not None
        return bool(row["claimed"]), row["code"]

    async def pending_page(self, agent_id: uuid.UUID, channel: str, page: Page) -> list[RequestListing]:
        rows = await self.db.fetchall(
            Q["pending_page"],
            {
                "agent_id": agent_id,
                "channel": channel,
                "ttl": self.ttl_seconds,
                "limit": page.fetch,
                "offset": page.offset,
            },
            what="list pending requests",
        )
        return [RequestListing(**row) for row in rows]

    async def allowlist_page(self, agent_id: uuid.UUID, channel: str, page: Page) -> list[EntryListing]:
        rows = await self.db.fetchall(
            Q["allowlist_page"],
            {"agent_id": agent_id, "channel": channel, "limit": page.fetch, "offset": page.offset},
            what="list allowlist",
        )
        return [EntryListing(**row) for row in rows]

    async def purge(self, batch: int) -> tuple[int, int]:
        """Delete expired requests and reply claims; returns how many of each."""
        counts = []
        for query in ("purge_requests", "purge_claims"):
            total = 0
            while True:
                deleted = await self.db.execute(
                    Q[query], {"ttl": self.ttl_seconds, "batch": batch}, what="purge expired"
                )
                total += deleted
                if deleted < batch:
                    break
            counts.append(total)
        return counts[0], counts[1]

    async def pending_counts(self) -> dict[str, int]:
        rows = await self.db.fetchall(Q["pending_counts"], {"ttl": self.ttl_seconds}, what="count pending")
        return {row["channel"]: row["pending"] for row in rows}


def _connector(row: Row) -> Connector:
    return Connector(
        name=row["name"],
        namespace=row["namespace"],
        agent_id=row["agent_id"],
        source=row["source"],
        kind=row["kind"],
        created_at=row["created_at"],
        revoked_at=row["revoked_at"],
    )


@dataclass(frozen=True)
class Session:
    """A NATS connection a connector was admitted with."""

    server_id: str
    client_id: int


class ConnectorStore:
    def __init__(self, db: Database) -> None:
        self.db = db

    async def add(
        self,
        *,
        name: str,
        namespace: str,
        agent_id: uuid.UUID,
        source: str,
        kind: str,
        secret: bytes,
        api_key: bytes | None,
    ) -> Connector | None:
        """The new connector, or None when the name is taken."""
        row = await self.db.fetchone(
            Q["add_connector"],
            {
                "name": name,
                "namespace": namespace,
                "agent_id": agent_id,
                "source": source,
                "kind": kind,
                "secret_digest": secret,
                "api_key_digest": api_key,
            },
            what="add connector",
        )
        return None if row is None else _connector(row)

    async def find(
        self, namespace: str, agent_id: uuid.UUID | None, include_revoked: bool
    ) -> list[Connector]:
        rows = await self.db.fetchall(
            Q["list_connectors"],
            {"namespace": namespace, "agent_id": agent_id, "include_revoked": include_revoked},
            what="list connectors",
        )
        return [_connector(r) for r in rows]

    async def admit(self, name: str, secret: bytes, session: Session) -> Connector | None:
        """The connector presenting ``secret``, not revoked, with ``session`` recorded; else None."""
        row = await self.db.fetchone(
            Q["admit_connector"],
            {
                "name": name,
                "secret_digest": secret,
                "server_id": session.server_id,
                "client_id": session.client_id,
            },
            what="admit connector",
        )
        return None if row is None else _connector(row)

    async def revoke(self, namespace: str, name: str) -> tuple[Connector, list[Session]] | None:
        """Revoke once: the connector and its recorded connections, or None (unknown or revoked)."""
        row = await self.db.fetchone(
            Q["revoke_connector"], {"namespace": namespace, "name": name}, what="revoke connector"
        )
        if row is None:
            return None
        sessions = []
        for entry in row["sessions"]:
            server_id, _, client_id = entry.rpartition(" ")
            sessions.append(Session(server_id, int(client_id)))
        return _connector(row), sessions

    async def by_api_key(self, api_key: bytes) -> Connector | None:
        row = await self.db.fetchone(Q["connector_by_api_key"], {"api_key_digest": api_key}, what="api key")
        return None if row is None else _connector(row)
