"""The turns' message embeddings, batched (turn/embeddings.py), against a real PostgreSQL: turns
finishing together share one embedding call and one statement, every embedding lands, and a text
or vector refused in a shared call or statement fails only the turn it came from. And the memories a
turn remembers together (REFLECTION's) are one embedding call and one statement.

The embedding calls go to ``Embedder``, which computes a vector from each text the way a model
would be asked to (one call for a list of texts) and counts the calls; the statements are real."""

from __future__ import annotations

import asyncio
import random
import struct
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from types import SimpleNamespace
from typing import Any

import psycopg
import pytest

from parley_platform import codes
from parley_platform.errors import ParleyError
from parley_platform.postgres import Database, Vector, migrate
from parley_runtime.records import StoredMemory
from parley_runtime.sdk import NewMemory
from parley_runtime.store import MIGRATIONS_DIR, SCHEMA, RuntimeStore
from parley_runtime.turn.embeddings import MAX_TEXTS, MessageEmbeddings
from parley_runtime.turn.services import Resources, TurnServices
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


class Embedder:
    """Embeds "fact <i>" as ``vector(i)``, "nan" as a vector the database refuses, and refuses a
    "too long" text as the gateway would (INVALID_ARGUMENT); it records each call's texts."""

    def __init__(self) -> None:
        self.calls: list[list[str]] = []

    async def __call__(self, texts: Sequence[str], agent_id: uuid.UUID) -> list[list[float]]:
        self.calls.append(list(texts))
        await asyncio.sleep(0)  # a call takes a while: others arrive meanwhile
        if "too long" in texts:
            raise codes.INVALID_ARGUMENT("texts[0] is over 65536 characters")
        return [[float("nan")] * DIMS if t == "nan" else vector(int(t.split()[1])) for t in texts]


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
    await store.remember(
        agent_id=agent_id,
        room_id=None,
        entity_id=None,
        source=None,
        memories=[StoredMemory(memory_id, "facts", f"fact {i}", None, {}) for i, memory_id in enumerate(ids)],
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


async def test_concurrent_turns_share_calls_and_statements_and_every_embedding_lands(db: Database) -> None:
    store, embed = CountingStore(db), Embedder()
    agent_id, ids = await memories(store, 40)
    other_agent, other_ids = await memories(store, 10)
    embeddings = MessageEmbeddings(store, embed)
    await asyncio.gather(
        *(embeddings.add(agent_id, [(m, f"fact {i}")]) for i, m in enumerate(ids)),
        *(embeddings.add(other_agent, [(m, f"fact {100 + i}")]) for i, m in enumerate(other_ids)),
    )
    # All 50 were handed over before the event loop's next turn: one call and one statement per
    # agent.
    assert store.statements == 2, store.statements
    assert sorted(len(texts) for texts in embed.calls) == [10, 40]
    assert await stored(db, agent_id) == {m: float(i) for i, m in enumerate(ids)}
    assert await stored(db, other_agent) == {m: float(100 + i) for i, m in enumerate(other_ids)}


async def test_turns_within_the_window_share_one_call_and_one_statement(db: Database) -> None:
    """Sequential turns (each hands its texts over after the previous one's) within the window
    share the batch; a turn after it starts the next one."""
    store, embed = CountingStore(db), Embedder()
    agent_id, ids = await memories(store, 6)
    embeddings = MessageEmbeddings(store, embed, window=0.3)
    started = time.monotonic()
    waiting = []
    for i, m in enumerate(ids[:5]):
        waiting.append(asyncio.create_task(embeddings.add(agent_id, [(m, f"fact {i}")])))
        await asyncio.sleep(0.01)
    await asyncio.gather(*waiting)
    assert time.monotonic() - started >= 0.3  # they waited for the window
    assert embed.calls == [[f"fact {i}" for i in range(5)]]
    assert store.statements == 1
    await embeddings.add(agent_id, [(ids[5], "fact 5")])
    assert len(embed.calls) == 2
    assert store.statements == 2
    assert await stored(db, agent_id) == {m: float(i) for i, m in enumerate(ids)}


async def test_a_lone_turn_is_its_own_call_and_statement(db: Database) -> None:
    store, embed = CountingStore(db), Embedder()
    agent_id, [memory_id] = await memories(store, 1)
    embeddings = MessageEmbeddings(store, embed)
    await embeddings.add(agent_id, [(memory_id, "fact 7")])
    assert store.statements == 1
    assert embed.calls == [["fact 7"]]
    assert await stored(db, agent_id) == {memory_id: 7.0}
    await embeddings.add(agent_id, [(memory_id, "  ")])  # nothing to embed: no call, no statement
    assert store.statements == 1
    assert len(embed.calls) == 1


async def test_calls_carry_at_most_max_texts(db: Database) -> None:
    store, embed = CountingStore(db), Embedder()
    agent_id, ids = await memories(store, MAX_TEXTS + 10)
    embeddings = MessageEmbeddings(store, embed)
    pairs = [ids[i : i + 2] for i in range(0, len(ids), 2)]
    await asyncio.gather(
        *(
            embeddings.add(agent_id, [(m, f"fact {ids.index(m)}") for m in pair])
            for pair in pairs  # each turn: its message and its reply
        )
    )
    assert [len(texts) for texts in embed.calls] == [MAX_TEXTS, 10]
    assert store.statements == 2
    assert await stored(db, agent_id) == {m: float(i) for i, m in enumerate(ids)}


async def test_a_refused_vector_fails_only_its_turn_and_later_batches_still_run(db: Database) -> None:
    store, embed = CountingStore(db), Embedder()
    agent_id, ids = await memories(store, 4)
    embeddings = MessageEmbeddings(store, embed)
    results = await asyncio.gather(
        embeddings.add(agent_id, [(ids[0], "fact 1")]),
        embeddings.add(agent_id, [(ids[1], "nan")]),  # pgvector refuses NaN
        embeddings.add(agent_id, [(ids[2], "fact 2")]),
        return_exceptions=True,
    )
    # The shared statement was refused as a whole; each turn then went alone, and only the turn
    # with the bad vector hears it (the turns log it; the backfill task embeds it later).
    assert results[0] is None
    assert isinstance(results[1], ParleyError)
    assert results[2] is None
    assert store.statements == 4  # the shared one, then one each
    await embeddings.add(agent_id, [(ids[3], "fact 3")])
    assert await stored(db, agent_id) == {ids[0]: 1.0, ids[1]: None, ids[2]: 2.0, ids[3]: 3.0}


async def test_a_text_the_gateway_refuses_fails_only_its_turn(db: Database) -> None:
    store, embed = CountingStore(db), Embedder()
    agent_id, ids = await memories(store, 3)
    embeddings = MessageEmbeddings(store, embed)
    results = await asyncio.gather(
        embeddings.add(agent_id, [(ids[0], "fact 4")]),
        embeddings.add(agent_id, [(ids[1], "too long"), (ids[2], "fact 6")]),
        return_exceptions=True,
    )
    assert results[0] is None
    assert isinstance(results[1], ParleyError)
    assert results[1].code == "INVALID_ARGUMENT"
    assert embed.calls == [["fact 4", "too long", "fact 6"], ["fact 4"], ["too long", "fact 6"]]
    assert await stored(db, agent_id) == {ids[0]: 4.0, ids[1]: None, ids[2]: None}


async def test_a_caller_that_gives_up_does_not_stop_the_others(db: Database) -> None:
    store, embed = CountingStore(db), Embedder()
    agent_id, ids = await memories(store, 2)
    embeddings = MessageEmbeddings(store, embed, window=0.2)
    gone = asyncio.create_task(embeddings.add(agent_id, [(ids[0], "fact 1")]))
    staying = asyncio.create_task(embeddings.add(agent_id, [(ids[1], "fact 2")]))
    await asyncio.sleep(0.05)
    gone.cancel()
    await staying
    assert gone.cancelled()
    # The batch still ran for both: the texts were handed over before the caller left.
    assert await stored(db, agent_id) == {ids[0]: 1.0, ids[1]: 2.0}


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


class RememberingStore(RuntimeStore):
    """The real store, counting its remember statements."""

    statements = 0

    async def remember(self, **kwargs: Any) -> None:
        self.statements += 1
        await super().remember(**kwargs)


async def test_remember_all_is_one_embedding_call_and_one_statement(db: Database) -> None:
    """What REFLECTION found in a turn is stored together: the texts in one Embed call, the rows in
    one statement, each memory once (the same kind and text in a room is one memory)."""
    store, embed = RememberingStore(db), Embedder()
    agent_id, _ = await memories(store, 0)
    store.statements = 0
    resources = Resources(store, None, SimpleNamespace(embed=embed), None)  # type: ignore[arg-type]
    message = SimpleNamespace(room_id=None, sender_id=None, source="test")
    services = TurnServices(resources, SimpleNamespace(id=agent_id), message)  # type: ignore[arg-type]
    ids = await services.remember_all(
        [
            NewMemory("facts", "fact 1", {"source": "reflection"}),
            NewMemory("facts", "fact 2"),
            NewMemory("facts", "fact 1", {"source": "reflection"}),
            NewMemory("reflections", "fact 3"),
        ]
    )
    assert ids[0] == ids[2]
    assert len(set(ids)) == 3
    assert (embed.calls, store.statements) == ([["fact 1", "fact 2", "fact 3"]], 1)
    assert await stored(db, agent_id) == {ids[0]: 1.0, ids[1]: 2.0, ids[3]: 3.0}
    rows = await db.fetchall(
        "SELECT id, kind, content ->> 'text' AS text, metadata, source FROM runtime.memory"
        " WHERE agent_id = %(a)s ORDER BY content ->> 'text'",
        {"a": agent_id},
    )
    assert [(r["id"], r["kind"], r["text"], r["metadata"], r["source"]) for r in rows] == [
        (ids[0], "facts", "fact 1", {"source": "reflection"}, "test"),
        (ids[1], "facts", "fact 2", {}, "test"),
        (ids[3], "reflections", "fact 3", {}, "test"),
    ]
    assert services.present == {"facts": True, "reflections": True}
    # Remembered again, one at a time: the same id, nothing added; nothing to remember costs nothing.
    assert await services.remember("facts", "fact 2") == ids[1]
    assert await services.remember_all([]) == []
    assert len(await stored(db, agent_id)) == 3
    assert (len(embed.calls), store.statements) == (2, 2)


async def test_an_embedding_the_turn_computed_is_stored_without_another_call(db: Database) -> None:
    """The message's vector, computed to search with it, is stored as it is: only the reply's text
    is embedded, in the same batch and statement as the other turns'; a turn whose every vector is
    known makes no call."""
    store, embed = CountingStore(db), Embedder()
    agent_id, ids = await memories(store, 5)
    embeddings = MessageEmbeddings(store, embed)
    await asyncio.gather(
        embeddings.add(agent_id, [(ids[0], "fact 0"), (ids[1], "fact 1")], {ids[0]: vector(50)}),
        embeddings.add(agent_id, [(ids[2], "fact 2"), (ids[3], "fact 3")]),
    )
    assert (embed.calls, store.statements) == ([["fact 1", "fact 2", "fact 3"]], 1)
    await embeddings.add(agent_id, [(ids[4], "fact 4")], {ids[4]: vector(60)})
    assert (len(embed.calls), store.statements) == (1, 2)
    assert await stored(db, agent_id) == {ids[0]: 50.0, ids[1]: 1.0, ids[2]: 2.0, ids[3]: 3.0, ids[4]: 60.0}


async def test_a_turn_embeds_a_text_once_however_many_search_with_it(db: Database) -> None:
    """The facts and the documents providers search with the message at the same time: one call.
    A failed call is not kept (the next caller asks again); a caller that gives up does not cancel
    it for the others."""
    store, embed = RememberingStore(db), Embedder()
    agent_id, _ = await memories(store, 0)
    resources = Resources(store, None, SimpleNamespace(embed=embed), None)  # type: ignore[arg-type]
    message = SimpleNamespace(room_id=None, sender_id=None, source="test")
    services = TurnServices(resources, SimpleNamespace(id=agent_id), message)  # type: ignore[arg-type]
    assert services.embedded("fact 4") is None
    first, second = await asyncio.gather(services.embedding("fact 4"), services.embedding("fact 4"))
    assert first == second == vector(4)
    assert embed.calls == [["fact 4"]]
    assert services.embedded("fact 4") == vector(4)
    assert await services.embedding("fact 4") == vector(4)
    assert len(embed.calls) == 1

    with pytest.raises(ParleyError):
        await services.embedding("too long")
    assert services.embedded("too long") is None
    with pytest.raises(ParleyError):
        await services.embedding("too long")
    assert embed.calls[1:] == [["too long"], ["too long"]]

    impatient = asyncio.create_task(services.embedding("fact 5"))
    patient = asyncio.create_task(services.embedding("fact 5"))
    await asyncio.sleep(0)
    impatient.cancel()
    assert await patient == vector(5)
    assert services.embedded("fact 5") == vector(5)
