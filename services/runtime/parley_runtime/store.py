"""The runtime's storage: named queries over the ``runtime`` schema, every one filtered by agent."""

from __future__ import annotations

import dataclasses
import re
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from psycopg import AsyncRawCursor
from psycopg.rows import dict_row
from psycopg.types.json import Jsonb

from parley.v1 import runtime_pb2
from parley_platform.postgres import Database, Vector, load_queries, pipeline

from .names import ROOM_TYPES
from .records import (
    Effect,
    Ingested,
    Invocation,
    Memory,
    MemoryMatch,
    NewMessage,
    Row,
    StoredAgent,
    StoredMemory,
    StoredReply,
    ToolCall,
    TurnRecord,
)

SQL_DIR = Path(__file__).parent / "sql"
MIGRATIONS_DIR = SQL_DIR / "migrations"
SCHEMA = "runtime"
Q = load_queries(SQL_DIR / "queries.sql")


def positional(query: str) -> tuple[str, tuple[str, ...]]:
    """A named-parameter query as PostgreSQL's own ``$n`` form and the names in order. psycopg
    converts a query on every execution once it is longer than 4,096 characters (shorter ones are
    cached); the ingest statement is longer, so it is converted once here and run by a raw cursor."""
    names: list[str] = []

    def number(match: re.Match[str]) -> str:
        name = match.group(1)
        if name not in names:
            names.append(name)
        return f"${names.index(name) + 1}"

    if "%%" in query:
        raise ValueError("a literal % in a query to convert to $n form")
    return re.sub(r"%\((\w+)\)s", number, query), tuple(names)


INGEST, INGEST_PARAMS = positional(Q["ingest"])


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

    async def list_agents(self, limit: int, offset: int) -> list[StoredAgent]:
        rows = await self.db.fetchall(
            Q["list_agents"], {"limit": limit, "offset": offset}, what="list agents"
        )
        return [StoredAgent.from_row(r) for r in rows]

    async def ingest(self, message: NewMessage) -> Ingested:
        """The ingest statement under the room's transaction-scoped advisory lock (one pipeline)."""
        params = {
            **{f.name: getattr(message, f.name) for f in dataclasses.fields(message)},
            "entity_metadata": Jsonb(message.entity_metadata),
            "content": Jsonb(message.content),
        }
        async with self.db.connection("ingest message") as conn:
            cur = AsyncRawCursor(conn, row_factory=dict_row)
            # The connection is in autocommit: what a pipeline sends before its Sync is one
            # (implicit) transaction, so the room's lock is held until the ingest has committed,
            # with one Sync and no BEGIN or COMMIT of their own. Each statement has its own snapshot:
            # the ingest sees every ingest of the room that held the lock before it.
            async with pipeline(conn):
                await conn.execute(
                    Q["lock_room"], {"lock_key": f"{message.agent_id}:{message.room_id}"}, prepare=True
                )
                await cur.execute(INGEST, [params[name] for name in INGEST_PARAMS], prepare=True)
            row = await cur.fetchone()
        assert row is not None
        return Ingested.from_row(row)

    async def save_replies(
        self,
        *,
        agent_id: uuid.UUID,
        room_id: uuid.UUID,
        turn_id: uuid.UUID,
        lease_token: int,
        replies: Sequence[tuple[uuid.UUID, dict[str, Any]]],
        source: str,
        trajectory: dict[str, Any] | None,
        keep: bool,
    ) -> str | None:
        """Returns 'replied', 'superseded', or None when a copy of the message holds the turn.

        The turn's one synchronous commit: the saves of turns finishing together are one group
        (``Database.fetchone_grouped``), one round trip and one WAL flush. It delays each turn's
        publish behind its group, which ordering does not depend on (``Outbox.publish_turn``)."""
        row = await self.db.fetchone_grouped(
            Q["save_replies"],
            {
                "agent_id": agent_id,
                "room_id": room_id,
                "turn_id": turn_id,
                "lease_token": lease_token,
                "response_ids": [rid for rid, _ in replies],
                "contents": [Jsonb(content) for _, content in replies],
                "source": source,
                "trajectory": Jsonb(trajectory) if trajectory is not None else None,
                "keep": keep,
            },
            what="save replies",
        )
        return None if row is None else str(row["state"])

    async def finish_turn(
        self,
        agent_id: uuid.UUID,
        turn_id: uuid.UUID,
        state: str,
        *,
        lease_token: int | None,
        reason: str | None = None,
        error: str | None = None,
        trajectory: dict[str, Any] | None = None,
    ) -> bool:
        row = await self.db.fetchone(
            Q["finish_turn"],
            {
                "agent_id": agent_id,
                "turn_id": turn_id,
                "state": state,
                "reason": reason,
                "error": error,
                "lease_token": lease_token,
                "trajectory": Jsonb(trajectory) if trajectory is not None else None,
            },
            what="finish turn",
        )
        return row is not None

    async def save_ignore(
        self,
        *,
        agent_id: uuid.UUID,
        room_id: uuid.UUID,
        turn_id: uuid.UUID,
        memory_id: uuid.UUID,
        lease_token: int,
        content: dict[str, Any],
        source: str,
        reason: str,
        trajectory: dict[str, Any] | None,
    ) -> bool:
        row = await self.db.fetchone(
            Q["save_ignore"],
            {
                "agent_id": agent_id,
                "room_id": room_id,
                "turn_id": turn_id,
                "memory_id": memory_id,
                "lease_token": lease_token,
                "content": Jsonb(content),
                "source": source,
                "reason": reason,
                "trajectory": Jsonb(trajectory) if trajectory is not None else None,
            },
            what="save ignore",
        )
        return row is not None

    async def add_trajectory(self, agent_id: uuid.UUID, turn_id: uuid.UUID, patch: dict[str, Any]) -> None:
        await self.db.execute(
            Q["add_trajectory"],
            {"agent_id": agent_id, "turn_id": turn_id, "patch": Jsonb(patch)},
            what="trajectory",
        )

    async def list_replies(self, agent_id: uuid.UUID, turn_id: uuid.UUID) -> list[StoredReply]:
        rows = await self.db.fetchall(
            Q["list_replies"], {"agent_id": agent_id, "turn_id": turn_id}, what="replies"
        )
        return [StoredReply(r["id"], r["content"]) for r in rows]

    async def set_room_state(
        self, agent_id: uuid.UUID, room_id: uuid.UUID, state: str | None, mute_until: Any = None
    ) -> None:
        await self.db.execute(
            Q["set_room_state"],
            {"agent_id": agent_id, "room_id": room_id, "state": state, "mute_until": mute_until},
            what="set room state",
        )

    async def lift_expired_mute(self, agent_id: uuid.UUID, room_id: uuid.UUID) -> bool:
        row = await self.db.fetchone(
            Q["lift_expired_mute"], {"agent_id": agent_id, "room_id": room_id}, what="lift mute"
        )
        return row is not None

    async def lift_expired_world_mute(self, agent_id: uuid.UUID, world_id: uuid.UUID) -> bool:
        row = await self.db.fetchone(
            Q["lift_expired_world_mute"], {"agent_id": agent_id, "world_id": world_id}, what="lift world mute"
        )
        return row is not None

    async def claim_effect(self, agent_id: uuid.UUID, turn_id: uuid.UUID, index: int, action: str) -> bool:
        """True when this call wrote the claim; False when one existed already."""
        row = await self.db.fetchone(
            Q["claim_effect"],
            {"agent_id": agent_id, "turn_id": turn_id, "action_index": index, "action": action},
            what="claim effect",
        )
        return row is not None

    async def get_effect(self, agent_id: uuid.UUID, turn_id: uuid.UUID, index: int) -> Effect | None:
        row = await self.db.fetchone(
            Q["get_effect"],
            {"agent_id": agent_id, "turn_id": turn_id, "action_index": index},
            what="get effect",
        )
        return None if row is None else Effect(row["result"])

    async def complete_effect(
        self, agent_id: uuid.UUID, turn_id: uuid.UUID, index: int, result: dict[str, Any]
    ) -> None:
        await self.db.execute(
            Q["complete_effect"],
            {"agent_id": agent_id, "turn_id": turn_id, "action_index": index, "result": Jsonb(result)},
            what="complete effect",
        )

    async def remember(
        self,
        *,
        agent_id: uuid.UUID,
        room_id: uuid.UUID | None,
        entity_id: uuid.UUID | None,
        source: str | None,
        memories: Sequence[StoredMemory],
    ) -> None:
        """Several memories of one room and sender in one statement."""
        if not memories:
            return
        await self.db.execute(
            Q["remember"],
            {
                "agent_id": agent_id,
                "room_id": room_id,
                "entity_id": entity_id,
                "source": source,
                "ids": [m.id for m in memories],
                "kinds": [m.kind for m in memories],
                "contents": [Jsonb({"text": m.text}) for m in memories],
                "embeddings": [Vector.of(m.embedding) for m in memories],
                "metadatas": [Jsonb(dict(m.metadata)) for m in memories],
            },
            what="remember",
        )

    async def relate(
        self,
        *,
        agent_id: uuid.UUID,
        source_entity_id: uuid.UUID,
        target_entity_id: uuid.UUID,
        tags: Sequence[str],
        metadata: dict[str, Any],
    ) -> uuid.UUID:
        row = await self.db.fetchone(
            Q["reflect_relationship"],
            {
                "agent_id": agent_id,
                "id": uuid.uuid5(agent_id, f"relationship:{source_entity_id}:{target_entity_id}"),
                "source_entity_id": source_entity_id,
                "target_entity_id": target_entity_id,
                "tags": list(tags),
                "metadata": Jsonb(metadata),
            },
            what="relate",
        )
        assert row is not None
        return uuid.UUID(str(row["id"]))

    async def set_embeddings(
        self, agent_id: uuid.UUID, embeddings: Sequence[tuple[uuid.UUID, Sequence[float]]]
    ) -> None:
        """Several memories' embeddings in one statement."""
        if not embeddings:
            return
        await self.db.execute(
            Q["set_embeddings"],
            {
                "agent_id": agent_id,
                "ids": [memory_id for memory_id, _ in embeddings],
                "embeddings": [Vector(vector) for _, vector in embeddings],
            },
            what="set embeddings",
        )

    async def search_memories(
        self,
        agent_id: uuid.UUID,
        embedding: Sequence[float],
        *,
        kind: str,
        limit: int,
        room_id: uuid.UUID | None = None,
    ) -> list[MemoryMatch]:
        rows = await self.db.fetchall(
            Q["search_memories"],
            {
                "agent_id": agent_id,
                "embedding": Vector.of(embedding),
                "kind": kind,
                "limit": limit,
                "room_id": room_id,
            },
            what="search memories",
            # One room's search (the operator's) is planned for its room: a generic plan would rank
            # every memory of the kind and filter. The turn's search, agent-wide, stays prepared.
            prepare=room_id is None,
        )
        return [MemoryMatch.from_row(r) for r in rows]

    async def has_memories(self, agent_id: uuid.UUID, kind: str) -> bool:
        row = await self.db.fetchone(
            Q["has_memories"], {"agent_id": agent_id, "kind": kind}, what="has memories"
        )
        return bool(row and row["found"])

    async def list_memories(
        self, agent_id: uuid.UUID, kind: str, room_id: uuid.UUID | None, limit: int, offset: int
    ) -> list[Memory]:
        rows = await self.db.fetchall(
            Q["list_memories"],
            {"agent_id": agent_id, "kind": kind, "room_id": room_id, "limit": limit, "offset": offset},
            what="list memories",
            prepare=False,
        )
        return [Memory.from_row(r) for r in rows]

    async def list_turns(
        self, agent_id: uuid.UUID, room_id: uuid.UUID | None, limit: int, offset: int
    ) -> list[TurnRecord]:
        rows = await self.db.fetchall(
            Q["list_turns"],
            {"agent_id": agent_id, "room_id": room_id, "limit": limit, "offset": offset},
            what="list turns",
            prepare=False,
        )
        return [TurnRecord.from_row(r) for r in rows]

    async def store_secrets(self, agent_id: uuid.UUID, encrypted: Mapping[str, str]) -> None:
        """Replace the agent's secrets with these (name → ciphertext)."""
        async with self.db.connection("store secrets") as conn, conn.transaction():
            for name, ciphertext in encrypted.items():
                await conn.execute(
                    Q["upsert_secret"], {"agent_id": agent_id, "name": name, "ciphertext": ciphertext}
                )
            await conn.execute(Q["delete_other_secrets"], {"agent_id": agent_id, "keep": list(encrypted)})

    async def list_secrets(self, agent_id: uuid.UUID) -> dict[str, str]:
        """The agent's secrets, name → ciphertext."""
        rows = await self.db.fetchall(Q["list_secrets"], {"agent_id": agent_id}, what="list secrets")
        return {r["name"]: r["ciphertext"] for r in rows}

    async def get_agent(self, ref: uuid.UUID | None, name: str | None) -> StoredAgent | None:
        row = await self.db.fetchone(Q["get_agent"], {"id": ref, "name": name}, what="get agent")
        return None if row is None else StoredAgent.from_row(row)

    async def set_agent_enabled(self, agent_id: uuid.UUID, enabled: bool) -> bool:
        row = await self.db.fetchone(
            Q["set_agent_enabled"], {"id": agent_id, "enabled": enabled}, what="enable"
        )
        return row is not None

    async def get_turn(self, agent_id: uuid.UUID, turn_id: uuid.UUID) -> TurnRecord | None:
        row = await self.db.fetchone(Q["get_turn"], {"agent_id": agent_id, "id": turn_id}, what="get turn")
        return None if row is None else TurnRecord.from_row(row)

    async def missing_embeddings(self, agent_id: uuid.UUID, limit: int) -> list[tuple[uuid.UUID, str]]:
        """(memory id, text) of messages and facts stored while the embedding model was away."""
        rows = await self.db.fetchall(
            Q["missing_embeddings"], {"agent_id": agent_id, "limit": limit}, what="missing embeddings"
        )
        return [(r["id"], r["text"]) for r in rows]

    # -- confirmations ---------------------------------------------------------------------------

    async def save_tool_call(self, call: ToolCall) -> ToolCall:
        """The proposal of an action awaiting confirmation; the first one when it exists already."""
        row = await self.db.fetchone(
            Q["save_tool_call"],
            {
                "agent_id": call.agent_id,
                "tool_call_id": call.id,
                "turn_id": call.turn_id,
                "action_index": call.action_index,
                "call_index": call.call_index,
                "room_id": call.room_id,
                "message_id": call.message_id,
                "action": call.action,
                "params": Jsonb(call.params),
                "requester_id": call.requester_id,
                "role": call.role,
                "invocation": Jsonb(call.invocation.to_json()),
            },
            what="save tool call",
        )
        assert row is not None  # inserted, or found by the same statement
        return _tool_call(row)

    async def get_tool_call(self, agent_id: uuid.UUID, tool_call_id: str) -> ToolCall | None:
        row = await self.db.fetchone(
            Q["get_tool_call"], {"agent_id": agent_id, "tool_call_id": tool_call_id}, what="get tool call"
        )
        return None if row is None else _tool_call(row)

    async def get_tool_calls(self, agent_id: uuid.UUID, ids: Sequence[str]) -> list[ToolCall]:
        rows = await self.db.fetchall(
            Q["get_tool_calls"], {"agent_id": agent_id, "ids": list(ids)}, what="get tool calls"
        )
        return [_tool_call(r) for r in rows]


def _tool_call(row: Row) -> ToolCall:
    return ToolCall(
        id=row["tool_call_id"],
        agent_id=row["agent_id"],
        turn_id=row["turn_id"],
        action_index=row["action_index"],
        call_index=row["call_index"],
        room_id=row["room_id"],
        message_id=row["message_id"],
        action=row["action"],
        params=row["params"],
        requester_id=row["requester_id"],
        role=row["role"],
        invocation=(
            Invocation.from_json(row["invocation"])
            if row["invocation"] is not None
            else _legacy_invocation(row["inbound"])
        ),
        created_at=row["created_at"],
    )


def _legacy_invocation(data: bytes) -> Invocation:
    """Calls proposed before migration 0007 kept the proposing message as protobuf bytes."""
    message = runtime_pb2.InboundMessage.FromString(data)
    return Invocation(
        source=message.source,
        message_id=message.message_id,
        channel_id=message.channel_id,
        sender_id=message.sender_id,
        sender_name=message.sender_name,
        sender_username=message.sender_username,
        room_type=ROOM_TYPES.get(message.room_type, "GROUP"),
        world_id=message.world_id,
        text=message.text,
        in_reply_to=message.in_reply_to,
        metadata=dict(message.metadata),
        attachments=[
            {"id": a.id, "url": a.url, "title": a.title, "contentType": a.content_type, "text": a.text}
            for a in message.attachments
        ],
    )
