"""The runtime's reads cost what they return, not the agent's whole history (migration 0012): a
turn reads its room's recent messages without reading the agent's other rooms and its room's
participants without reading every room the sender was in (`ingest`), and a redelivered turn
finds its stored replies without walking every message (`list_replies`); the operator's page of
rooms and the embedding backfill read what they return. Against a real PostgreSQL, with the plans
PostgreSQL actually ran."""

from __future__ import annotations

import dataclasses
import json
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
from psycopg.types.json import Jsonb

from parley_platform.postgres import Database, migrate
from parley_runtime.records import NewMessage
from parley_runtime.store import MIGRATIONS_DIR, SCHEMA, Q, RuntimeStore
from support import SessionEnv

HISTORY = 8
BUSY_ROOMS = 40
BUSY_MESSAGES = 30  # per busy room, all newer than the quiet room's


@pytest.fixture(scope="module")
async def store(test_env: SessionEnv) -> AsyncIterator[RuntimeStore]:
    await migrate(test_env.database_url, SCHEMA, MIGRATIONS_DIR)
    database = Database(test_env.database_url, name="room-history-tests", min_size=1, max_size=4)
    await database.open()
    await other_agents_history(database)
    yield RuntimeStore(database)
    await database.close()


async def other_agents_history(database: Database, agents: int = 4, turns: int = 1500) -> None:
    """What a shared database holds besides each test's agent: other agents' messages and their
    replies, analyzed. The planner's estimates for a new agent come from these statistics."""
    await database.execute(
        """WITH a AS (
               INSERT INTO runtime.agent (id, name, character, enabled)
               SELECT gen_random_uuid(), 'other-' || gen_random_uuid(), '{}'::jsonb, true
                 FROM generate_series(1, %(agents)s)
               RETURNING id),
           m AS (
               INSERT INTO runtime.memory (agent_id, id, room_id, entity_id, kind, content, created_at)
               SELECT a.id, gen_random_uuid(), gen_random_uuid(), gen_random_uuid(), 'messages',
                      jsonb_build_object('text', 'hello ' || i), now() - i * interval '1 second'
                 FROM a, generate_series(1, %(turns)s) AS i
               RETURNING agent_id, id, room_id, created_at)
           INSERT INTO runtime.memory (agent_id, id, room_id, entity_id, kind, content, in_reply_to,
                                       created_at)
           SELECT m.agent_id, gen_random_uuid(), m.room_id, m.agent_id, 'messages',
                  jsonb_build_object('text', 'reply'), m.id, m.created_at + interval '1 millisecond'
             FROM m""",
        {"agents": agents, "turns": turns},
        what="other agents",
    )
    await database.execute("ANALYZE runtime.memory", {}, what="analyze")


def message(agent_id: uuid.UUID, room_id: uuid.UUID, seq: int, text: str) -> NewMessage:
    return NewMessage(
        agent_id=agent_id,
        world_id=None,
        world_external_id=None,
        source="history",
        entity_id=uuid.uuid5(room_id, "user"),
        entity_names=[f"user of {room_id.hex[:6]}"],
        entity_metadata={},
        room_id=room_id,
        channel_id=f"channel-{room_id.hex[:8]}",
        room_type="DM",
        stream_epoch=1,
        stream_seq=seq,
        memory_id=uuid.uuid4(),
        content={"text": text},
        external_id=uuid.uuid4().hex,
        history=HISTORY,
        sender_role=None,
        reply_to_id=None,
    )


def params(sent: NewMessage) -> dict[str, Any]:
    return {
        **{name: getattr(sent, name) for name in sent.__dataclass_fields__},
        "entity_metadata": Jsonb(sent.entity_metadata),
        "content": Jsonb(sent.content),
    }


def nodes(plan: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield plan
    for child in plan.get("Plans", []):
        yield from nodes(child)


async def test_a_quiet_rooms_history_reads_only_that_room(store: RuntimeStore) -> None:
    agent_id = uuid.uuid4()
    await store.upsert_agent(agent_id, f"agent-{agent_id.hex[:8]}", {"name": "x"}, True)
    quiet = uuid.uuid4()
    seq = 0
    for i in range(HISTORY):
        seq += 1
        ingested = await store.ingest(message(agent_id, quiet, seq, f"quiet {i}"))
        assert ingested.state == "running"
    # Statistics from before the agent got busy (what a growing table has between autovacuums),
    # then it gets busy elsewhere: every one of these is newer than the quiet room's.
    await store.db.execute("ANALYZE runtime.memory", {}, what="analyze")
    for r in range(BUSY_ROOMS):
        room = uuid.uuid4()
        for i in range(BUSY_MESSAGES):
            seq += 1
            await store.ingest(message(agent_id, room, seq, f"busy {r}.{i}"))

    seq += 1
    ingested = await store.ingest(message(agent_id, quiet, seq, "back again"))
    assert [m.text for m in ingested.history] == [f"quiet {i}" for i in range(HISTORY)]

    # The same statement for the quiet room's next message, as PostgreSQL runs it (rolled back):
    # with the statistics of a table that grew since it was last analyzed, and after ANALYZE.
    for analyzed in (False, True):
        if analyzed:
            await store.db.execute("ANALYZE runtime.memory", {}, what="analyze")
        seq += 1
        scan = await history_scan(store, message(agent_id, quiet, seq, "and again"))
        # It walks the room's own messages, newest first, and stops after the history: nothing of
        # the busy rooms (1,200 newer messages) is read and dropped.
        assert scan.get("Index Name") == "memory_room_recent", (analyzed, scan)
        assert scan.get("Rows Removed by Filter", 0) <= 1, (analyzed, scan)  # the message itself
        assert scan["Actual Rows"] <= HISTORY, (analyzed, scan)


async def test_a_redelivered_turn_finds_its_replies_without_walking_the_agents_messages(
    store: RuntimeStore,
) -> None:
    agent_id = uuid.uuid4()
    await store.upsert_agent(agent_id, f"agent-{agent_id.hex[:8]}", {"name": "x"}, True)
    room, seq = uuid.uuid4(), 1
    answered = message(agent_id, room, seq, "answer me")
    ingested = await store.ingest(answered)
    assert ingested.lease_token is not None
    replies = [(uuid.uuid4(), {"text": f"reply {i}", "source": "history"}) for i in range(3)]
    state = await store.save_replies(
        agent_id=agent_id,
        room_id=room,
        turn_id=answered.memory_id,
        lease_token=ingested.lease_token,
        replies=replies,
        source="history",
        trajectory=None,
        keep=False,
    )
    assert state == "replied"
    await store.db.execute("ANALYZE runtime.memory", {}, what="analyze")  # statistics from before
    for i in range(BUSY_ROOMS * BUSY_MESSAGES):  # the agent's later messages, in several rooms
        seq += 1
        await store.ingest(message(agent_id, uuid.uuid5(room, str(i % BUSY_ROOMS)), seq, f"later {i}"))

    stored = await store.list_replies(agent_id, answered.memory_id)
    assert [(r.id, r.content["text"]) for r in stored] == [(rid, c["text"]) for rid, c in replies]
    values = {"agent_id": agent_id, "turn_id": answered.memory_id}
    for analyzed, mode in ((False, "auto"), (False, "force_generic_plan"), (True, "auto")):
        if analyzed:
            await store.db.execute("ANALYZE runtime.memory", {}, what="analyze")
        plan = await explain(store, Q["list_replies"], values, plan_cache_mode=mode)
        (scan,) = [n for n in nodes(plan) if n.get("Relation Name") == "memory"]
        assert scan.get("Index Name") == "memory_replies", (analyzed, mode, scan)
        assert scan.get("Rows Removed by Filter", 0) == 0, (analyzed, mode, scan)
        assert scan["Actual Rows"] == len(replies), (analyzed, mode, scan)


async def test_the_ingest_reads_the_rooms_participants_whatever_rooms_they_are_in(
    store: RuntimeStore,
) -> None:
    """The sender's and the agent's rows of the room, by all three keys: not every room the sender
    ever spoke in, also with the generic plan a pooled connection's prepared statement switches to."""
    agent_id = uuid.uuid4()
    await store.upsert_agent(agent_id, f"agent-{agent_id.hex[:8]}", {"name": "x"}, True)
    sender = uuid.uuid4()
    rooms = [uuid.uuid4() for _ in range(300)]
    for seq, room in enumerate(rooms, start=1):  # one sender, a new room each time (a web chat)
        sent = dataclasses.replace(message(agent_id, room, seq, "hi"), entity_id=sender)
        assert (await store.ingest(sent)).state == "running"
        # The agent's own row in the room (written when it is muted, followed, or echoed).
        await store.db.execute(
            "INSERT INTO runtime.participant (agent_id, room_id, entity_id, role)"
            " VALUES (%s, %s, %s, 'MEMBER')",
            (agent_id, room, agent_id),
            what="agent participant",
        )
    last = dataclasses.replace(message(agent_id, rooms[0], len(rooms) + 1, "again"), entity_id=sender)
    for mode in ("force_custom_plan", "force_generic_plan"):
        plan = await explain(store, Q["ingest"], params(last), plan_cache_mode=mode)
        scans = [n for n in nodes(plan) if n.get("Relation Name") == "participant" and n.get("Alias") != "px"]
        assert {n["Alias"] for n in scans} >= {"ap", "sp"}, scans
        for scan in scans:
            assert scan.get("Rows Removed by Filter", 0) == 0, (mode, scan)
            assert scan["Actual Rows"] <= 1, (mode, scan)


async def test_the_operators_page_of_rooms_is_linear_in_the_agents_rooms(store: RuntimeStore) -> None:
    """``parley rooms``: the agent's own row in each room read by its key, the page read in order."""
    agent_id = uuid.uuid4()
    await store.upsert_agent(agent_id, f"agent-{agent_id.hex[:8]}", {"name": "x"}, True)
    rooms = 400
    await store.db.execute(
        """WITH r AS (
               INSERT INTO runtime.room (agent_id, id, source, channel_id, type, created_at)
               SELECT %(agent)s, gen_random_uuid(), 'history', 'channel-' || i, 'GROUP',
                      now() - i * interval '1 second'
                 FROM generate_series(1, %(rooms)s) AS i
               RETURNING id)
           INSERT INTO runtime.participant (agent_id, room_id, entity_id, role, user_state)
           SELECT %(agent)s, r.id, %(agent)s, 'MEMBER', 'MUTED' FROM r""",
        {"agent": agent_id, "rooms": rooms},
        what="rooms",
    )
    values = {"agent_id": agent_id, "world_id": None, "limit": 51, "offset": 0}
    page = await store.db.fetchall(Q["list_rooms_admin"], values, what="rooms page")
    assert [r["channel_id"] for r in page] == [f"channel-{i}" for i in range(1, 52)]
    assert {r["user_state"] for r in page} == {"MUTED"}
    for mode in ("force_custom_plan", "force_generic_plan"):
        plan = await explain(store, Q["list_rooms_admin"], values, plan_cache_mode=mode)
        for node in nodes(plan):
            # Each room meets only its own agent row: nothing is compared with the others' rows.
            assert node.get("Rows Removed by Join Filter", 0) == 0, (mode, node)
            if node.get("Relation Name") == "participant":
                assert node.get("Rows Removed by Filter", 0) == 0, (mode, node)
                assert node["Actual Rows"] <= 1, (mode, node)


async def test_the_embedding_backfill_reads_only_the_memories_waiting_for_one(store: RuntimeStore) -> None:
    agent_id = uuid.uuid4()
    await store.upsert_agent(agent_id, f"agent-{agent_id.hex[:8]}", {"name": "x"}, True)
    room = uuid.uuid4()
    await store.db.execute("ANALYZE runtime.memory", {}, what="analyze")  # statistics from before
    for seq in range(1, 301):
        await store.ingest(message(agent_id, room, seq, f"message {seq}"))
    # Every message got its embedding but three (stored while the model was away).
    await store.db.execute(
        """UPDATE runtime.memory SET embedding = '[0.1, 0.2, 0.3]'::vector
            WHERE agent_id = %(agent)s AND content ->> 'text' <> ALL (%(waiting)s)""",
        {"agent": agent_id, "waiting": ["message 7", "message 70", "message 170"]},
        what="embeddings",
    )
    waiting = await store.missing_embeddings(agent_id, limit=10)
    assert [text for _, text in waiting] == ["message 170", "message 70", "message 7"]
    for analyzed in (False, True):
        if analyzed:
            await store.db.execute("ANALYZE runtime.memory", {}, what="analyze")
        plan = await explain(store, Q["missing_embeddings"], {"agent_id": agent_id, "limit": 10})
        (scan,) = [n for n in nodes(plan) if n.get("Relation Name") == "memory"]
        assert scan.get("Index Name") == "memory_missing_embedding", (analyzed, scan)
        assert scan.get("Rows Removed by Filter", 0) == 0, (analyzed, scan)
        assert scan["Actual Rows"] == 3, (analyzed, scan)


async def explain(
    store: RuntimeStore, sql: str, values: dict[str, Any], *, plan_cache_mode: str | None = None
) -> dict[str, Any]:
    """The plan of ``sql`` as PostgreSQL ran it (EXPLAIN ANALYZE, rolled back)."""
    async with store.db.connection("explain") as conn, conn.transaction(force_rollback=True):
        if plan_cache_mode is not None:
            await conn.execute("SELECT set_config('plan_cache_mode', %s, true)", (plan_cache_mode,))
        cursor = await conn.execute("EXPLAIN (ANALYZE, FORMAT JSON) " + sql, values)
        row = await cursor.fetchone()
    assert row is not None
    document = row[0] if not isinstance(row, dict) else next(iter(row.values()))
    plan: dict[str, Any] = (json.loads(document) if isinstance(document, str) else document)[0]["Plan"]
    return plan


async def history_scan(store: RuntimeStore, sent: NewMessage) -> dict[str, Any]:
    """The plan node that reads the room's history in the ingest of ``sent``."""
    plan = await explain(store, Q["ingest"], params(sent))
    scans = [n for n in nodes(plan) if n.get("Relation Name") == "memory" and n.get("Alias") == "m"]
    assert len(scans) == 1, scans
    return {k: v for k, v in scans[0].items() if k != "Plans"}
