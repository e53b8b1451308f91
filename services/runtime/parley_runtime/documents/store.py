"""The documents' named queries. Every one applies the rules of ``runtime.allowed_documents`` in
SQL (see ``sql/schema.sql``), so what a requester may not read never reaches a row, a count or a
ranking."""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from parley_platform.postgres import Database, Vector

from ..store import Q
from .domain import AddCheck, Document, Fragment, GrantReplacement, Removal, Requester


class DocumentStore:
    """The documents' named queries; every one applies the rules of runtime.allowed_documents in SQL."""

    def __init__(self, db: Database) -> None:
        self.db = db

    async def check_add(
        self, agent_id: uuid.UUID, requester: Requester, values: Mapping[str, Any]
    ) -> AddCheck:
        row = await self.db.fetchone(
            Q["check_add_document"], {"agent_id": agent_id, **requester.params(), **values}, what="check add"
        )
        assert row is not None
        return AddCheck(row["allowed"], row["room_found"], row["entities_found"])

    async def add(
        self,
        agent_id: uuid.UUID,
        requester: Requester,
        values: Mapping[str, Any],
        fragments: Sequence[str],
        embeddings: Sequence[Sequence[float]],
    ) -> Document | None:
        row = await self.db.fetchone(
            Q["add_document"],
            {
                "agent_id": agent_id,
                **requester.params(),
                **values,
                "fragments": list(fragments),
                "embeddings": [Vector.of(e) for e in embeddings],
            },
            what="add document",
        )
        return None if row is None else Document.from_row(row)

    async def page(
        self, agent_id: uuid.UUID, requester: Requester, room_id: uuid.UUID | None, limit: int, offset: int
    ) -> tuple[list[Document], int]:
        rows = await self.db.fetchall(
            Q["list_documents"],
            {
                "agent_id": agent_id,
                **requester.params(),
                "room_id": room_id,
                "limit": limit,
                "offset": offset,
            },
            what="list documents",
            prepare=False,
        )
        total = int(rows[0]["total"]) if rows else 0
        return [Document.from_row(r) for r in rows if r["id"] is not None], total

    async def get(
        self, agent_id: uuid.UUID, requester: Requester, document_id: uuid.UUID, include_text: bool
    ) -> Document | None:
        row = await self.db.fetchone(
            Q["get_document"],
            {"agent_id": agent_id, **requester.params(), "id": document_id, "include_text": include_text},
            what="get document",
        )
        return None if row is None else Document.from_row(row)

    async def remove(self, agent_id: uuid.UUID, requester: Requester, document_id: uuid.UUID) -> Removal:
        row = await self.db.fetchone(
            Q["remove_document"],
            {"agent_id": agent_id, **requester.params(), "id": document_id},
            what="remove document",
        )
        assert row is not None
        return Removal(row["fragments_removed"], bool(row["readable"]))

    async def replace_grants(
        self,
        agent_id: uuid.UUID,
        requester: Requester,
        document_id: uuid.UUID,
        expected: int,
        grants: Sequence[uuid.UUID],
    ) -> GrantReplacement:
        row = await self.db.fetchone(
            Q["replace_document_grants"],
            {
                "agent_id": agent_id,
                **requester.params(),
                "id": document_id,
                "expected": expected,
                "grants": list(grants),
            },
            what="replace document grants",
        )
        assert row is not None
        return GrantReplacement(
            document=Document.from_row(row) if row["id"] is not None else None,
            readable=bool(row["readable"]),
            may_grant=bool(row["may_grant"]),
            entities_found=bool(row["entities_found"]),
            current_revision=row["current_revision"],
        )

    async def search(
        self,
        agent_id: uuid.UUID,
        requester: Requester,
        embedding: Sequence[float],
        limit: int,
        room_id: uuid.UUID | None = None,
        scopes: Sequence[str] | None = None,
    ) -> list[Fragment]:
        rows = await self.db.fetchall(
            Q["search_document_fragments"],
            {
                "agent_id": agent_id,
                **requester.params(),
                "embedding": Vector.of(embedding),
                "limit": limit,
                "room_id": room_id,
                "scopes": list(scopes) if scopes is not None else None,
            },
            what="search documents",
        )
        return [
            Fragment(r["document_id"], r["position"], r["text"], r["title"], float(r["similarity"]))
            for r in rows
        ]

    async def has_documents(self, agent_id: uuid.UUID) -> bool:
        row = await self.db.fetchone(Q["has_documents"], {"agent_id": agent_id}, what="has documents")
        return bool(row and row["found"])
