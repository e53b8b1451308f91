"""Named queries over ``runtime.custom_action`` (see the custom actions section of queries.sql)."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import datetime

from psycopg.types.json import Jsonb

from parley_platform.errors import Conflict, InvalidArgument
from parley_platform.logging import get_logger
from parley_platform.postgres import Database, load_queries

from .. import errors
from ..custom.definitions import CustomActionDef, parse_definition
from ..store import SQL_DIR

Q = load_queries(SQL_DIR / "queries.sql")
log = get_logger(__name__)


@dataclass(frozen=True)
class StoredAction:
    definition: CustomActionDef
    created_at: datetime
    updated_at: datetime


class CustomActionStore:
    def __init__(self, db: Database) -> None:
        self.db = db

    async def upsert(self, agent_id: uuid.UUID, definition: CustomActionDef) -> tuple[StoredAction, int]:
        document = definition.model_copy(update={"created_at": None, "updated_at": None}).document()
        try:
            row = await self.db.fetchone(
                Q["upsert_custom_action"],
                {
                    "agent_id": agent_id,
                    "id": definition.id,
                    "name": definition.name,
                    "definition": Jsonb(document),
                    "enabled": definition.enabled,
                },
                what="save custom action",
            )
        except Conflict as exc:
            if exc.code != "ALREADY_EXISTS":
                raise
            raise errors.CUSTOM_ACTION_NAME_TAKEN(
                f"name: {definition.name} is already the name of another custom action of this agent"
            ) from None
        assert row is not None
        return _stored(row), int(row["revision"])

    async def delete(self, agent_id: uuid.UUID, action_id: str) -> int | None:
        """The new revision, or ``None`` when there was no such action."""
        row = await self.db.fetchone(
            Q["delete_custom_action"], {"agent_id": agent_id, "id": action_id}, what="remove custom action"
        )
        return None if row is None else int(row["revision"])

    async def revision(self, agent_id: uuid.UUID) -> int:
        row = await self.db.fetchone(
            Q["custom_action_revision"], {"agent_id": agent_id}, what="custom action revision"
        )
        return 0 if row is None else int(row["revision"])

    async def list(self, agent_id: uuid.UUID) -> tuple[int, list[StoredAction]]:
        rows = await self.db.fetchall(
            Q["list_custom_actions"], {"agent_id": agent_id}, what="list custom actions"
        )
        revision = int(rows[0]["revision"]) if rows else 0
        found = []
        for row in rows:
            if row["id"] is None:
                continue
            try:
                found.append(_stored(row))
            except InvalidArgument as exc:
                # One bad row (written by another version) must not stop this agent's turns.
                log.warning("stored custom action left out", agent_id=str(agent_id), error=exc.message)
        return revision, found


def _stored(row: dict[str, object]) -> StoredAction:
    created, updated = row["created_at"], row["updated_at"]
    assert isinstance(created, datetime)
    assert isinstance(updated, datetime)
    definition = parse_definition(row["definition"], f"stored custom action {row['id']}")
    return StoredAction(
        definition.model_copy(update={"created_at": created, "updated_at": updated}), created, updated
    )
