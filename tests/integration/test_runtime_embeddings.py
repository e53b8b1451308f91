"""The turns' message embeddings, batched (turn/embeddings.py), against a real PostgreSQL: concurrent
turns share statements, every embedding lands, and a failed statement reaches the callers of its
batch without stopping later batches."""

from __future__ import annotations

import asyncio
import random
import struct
import uuid
from collections.abc import AsyncIterator, Sequence

import psycopg
import pytest

from parley_platform.errors import ParleyError
from parley_platform.postgres import Database, Vector, migrate
from parley_runtime.store import MIGRATIONS_DIR, SCHEMA, RuntimeStore
from parley_runtime.turn.embeddings import EmbeddingWriter
from support import SessionEnv

DIMS = 8


class CountingStore(RuntimeStore):
    """The real store, counting its embedding statements."""

    statements = 0

    async def set_embeddings(
        self, agent_id: uuid.UUID, embeddings: Sequence[tuple[uuid.UUID, Sequence[float]]]
    ) -> None:
        self.statements += 1
        await super().set_embeddings(agent_id, embeddings)


@pytest.fixture(scope="module")
async def db(test_env: SessionEnv) -> AsyncIterator[Database]:
    await migrate(test_env.database_url, SCHEMA, MIGRATIONS_DIR)
    database = Database(test_env.database_url, name="embedding-tests", min_size=1, max_size=4)
    await database.open()
    yield database
    await database.close()


async def memories(store: RuntimeStore, n: int) -> tuple[uuid.UUID, list[uuid.UUID]]:
    """A fresh agent with ``n`` facts stored without embeddings."""
    agent_id = uuid.uuid4()
    await store.upsert_agent(agent_id, f"agent-{agent_id.hex[:8]}", {"name": "x"}, True)
    ids = [uuid.uuid4() for _ in range(n)]
    for i, memory_id in enumerate(ids):
        await store.remember(
            agent_id=agent_id,
            memory_id=memory_id,
            kind="facts",
            text=f"fact {i}",
            room_id=None,
            entity_id=None,
            source=None,
            embedding=None,
            metadata={},
        )
    return agent_id, ids


def vector(i: int) -> list[float]:
    return [float(i)] + [0.5] * (DIMS - 1)


async def stored(db: Database, agent_id: uuid.UUID) -> dict[uuid.UUID, float | None]:
    rows = await db.fetchall(
        "SELECT id, (embedding::real[])[1] AS first FROM runtime.memory WHERE agent_id = %(a)s",
        {"a": agent_id},
    )
    return {r["id"]: r["first"] for r in rows}


async def test_concurrent_turns_share_statements_and_every_embedding_lands(db: Database) -> None:
    store = CountingStore(db)
    agent_id, ids = await memories(store, 40)
    other_agent, other_ids = await memories(store, 10)
    writer = EmbeddingWriter(store)
    await asyncio.gather(
        *(writer.write(agent_id, [(m, vector(i))]) for i, m in enumerate(ids)),
        *(writer.write(other_agent, [(m, vector(100 + i))]) for i, m in enumerate(other_ids)),
    )
    # The first write starts a batch alone; the other 49 arrive while it runs and form the next,
    # one statement per agent.
    assert store.statements <= 3, store.statements
    assert await stored(db, agent_id) == {m: float(i) for i, m in enumerate(ids)}
    assert await stored(db, other_agent) == {m: float(100 + i) for i, m in enumerate(other_ids)}


async def test_a_lone_write_is_its_own_statement(db: Database) -> None:
    store = CountingStore(db)
    agent_id, [memory_id] = await memories(store, 1)
    writer = EmbeddingWriter(store)
    await writer.write(agent_id, [(memory_id, vector(7))])
    assert store.statements == 1
    assert await stored(db, agent_id) == {memory_id: 7.0}
    await writer.write(agent_id, [])  # nothing to write: no statement
    assert store.statements == 1


async def test_a_failed_batch_reaches_its_callers_and_later_batches_still_run(db: Database) -> None:
    store = CountingStore(db)
    agent_id, ids = await memories(store, 3)
    writer = EmbeddingWriter(store)
    bad = [float("nan")] * DIMS  # pgvector refuses NaN
    results = await asyncio.gather(
        writer.write(agent_id, [(ids[0], vector(1))]),
        writer.write(agent_id, [(ids[1], bad)]),
        return_exceptions=True,
    )
    # Both were handed over before the batch started: one statement, refused as a whole, and
    # both callers hear it (the turns log it; the backfill task embeds those memories later).
    assert all(isinstance(r, ParleyError) for r in results), results
    assert store.statements == 1
    await writer.write(agent_id, [(ids[2], vector(3))])
    assert await stored(db, agent_id) == {ids[0]: None, ids[1]: None, ids[2]: 3.0}


async def test_vectors_travel_in_binary_and_arrive_exactly(db: Database, fresh_database: str) -> None:
    """``Vector`` parameters are pgvector's binary form: a float32 embedding (what the gateway's
    protobuf carries) arrives bit for bit, alone, in a ``vector[]`` with NULLs, and a search with
    one finds it first; a pool opened before the extension existed learns the type on its next
    connection."""
    rng = random.Random(7)
    exact = [struct.unpack("f", struct.pack("f", rng.uniform(-1, 1)))[0] for _ in range(384)]
    row = await db.fetchone("SELECT %(v)s::vector::real[] AS v", {"v": Vector(exact)})
    assert row is not None
    assert struct.pack("384f", *row["v"]) == struct.pack("384f", *exact)  # as float32, bit for bit
    row = await db.fetchone(
        "SELECT (%(vs)b::vector[])::text[] AS vs", {"vs": [None, Vector([1.5, -2.0]), Vector([0.25, 8.0])]}
    )
    assert row is not None
    assert row["vs"] == [None, "[1.5,-2]", "[0.25,8]"]
    store = RuntimeStore(db)
    agent_id, ids = await memories(store, 3)
    await store.set_embeddings(
        agent_id, [(m, [float(i == n) for i in range(384)]) for n, m in enumerate(ids)]
    )
    matches = await store.search_memories(
        agent_id, [float(i == 1) for i in range(384)], kind="facts", limit=3
    )
    assert next(match.id for match in matches) == ids[1]

    fresh = Database(fresh_database, name="vector-tests", min_size=1, max_size=1)
    await fresh.open()
    try:
        async with fresh.connection() as conn:  # a database without pgvector: no Vector dumper
            with pytest.raises(psycopg.ProgrammingError):
                await conn.execute("SELECT %(v)s::text", {"v": Vector([1.0])})
            await conn.execute("CREATE EXTENSION IF NOT EXISTS vector")
            await conn.close()  # the pool replaces it: its next connection looks the type up again
        row = await fresh.fetchone("SELECT %(v)s::vector::text AS v", {"v": Vector([1.0, 2.0])})
        assert row is not None
        assert row["v"] == "[1,2]"
    finally:
        await fresh.close()
