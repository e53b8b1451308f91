"""The runtime's reads cost what they return, not the agent's whole history (migration 0012): a
turn reads its room's recent messages without reading the agent's other rooms and its room's
participants without reading every room the sender was in (`ingest`), and a redelivered turn
finds its stored replies without walking every message (`list_replies`); the operator's page of
rooms and the embedding backfill read what they return. Against a real PostgreSQL, with the plans
PostgreSQL actually ran."""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest
from psycopg.types.json import Jsonb

from parley_platform.postgres import Database
from parley_runtime.admin_store import AdminStore
from parley_runtime.documents.domain import Requester
from parley_runtime.documents.store import DocumentStore
from parley_runtime.records import NewMessage
from parley_runtime.store import Q, RuntimeStore
from support import (
    SessionEnv,
    explain,
    new_agent,
    new_message,
    plan_nodes,
    prepared_statements,
    runtime_store,
)

HISTORY = 8
BUSY_ROOMS = 40
BUSY_MESSAGES = 30  # per busy room, all newer than the quiet room's


@pytest.fixture(scope="module")
async def store(test_env: SessionEnv) -> AsyncIterator[RuntimeStore]:
    async with runtime_store(test_env.database_url, "room-history-tests") as store:
        await other_agents_history(store.db)
        yield store


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
    """One sender per room, as in a web chat."""
    return new_message(
        agent_id, room_id, seq, text, sender=uuid.uuid5(room_id, "user"), source="history", history=HISTORY
    )


def params(sent: NewMessage) -> dict[str, Any]:
    return {
        **{name: getattr(sent, name) for name in sent.__dataclass_fields__},
        "entity_metadata": Jsonb(sent.entity_metadata),
        "content": Jsonb(sent.content),
    }


async def test_a_quiet_rooms_history_reads_only_that_room(store: RuntimeStore) -> None:
    agent_id = await new_agent(store)
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
    agent_id = await new_agent(store)
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
    for analyzed, mode in ((False, None), (False, "force_generic_plan"), (True, None)):
        if analyzed:
            await store.db.execute("ANALYZE runtime.memory", {}, what="analyze")
        plan = await explain(store.db, Q["list_replies"], values, plan_cache_mode=mode)
        (scan,) = [n for n in plan_nodes(plan) if n.get("Relation Name") == "memory"]
        assert scan.get("Index Name") == "memory_replies", (analyzed, mode, scan)
        assert scan.get("Rows Removed by Filter", 0) == 0, (analyzed, mode, scan)
        assert scan["Actual Rows"] == len(replies), (analyzed, mode, scan)


async def test_the_ingest_reads_the_rooms_participants_whatever_rooms_they_are_in(
    store: RuntimeStore,
) -> None:
    """The sender's and the agent's rows of the room, by all three keys: not every room the sender
    ever spoke in, also with the generic plan a pooled connection's prepared statement switches to."""
    agent_id = await new_agent(store)
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
        plan = await explain(store.db, Q["ingest"], params(last), plan_cache_mode=mode)
        scans = [
            n for n in plan_nodes(plan) if n.get("Relation Name") == "participant" and n.get("Alias") != "px"
        ]
        assert {n["Alias"] for n in scans} >= {"ap", "sp"}, scans
        for scan in scans:
            assert scan.get("Rows Removed by Filter", 0) == 0, (mode, scan)
            assert scan["Actual Rows"] <= 1, (mode, scan)


async def test_the_operators_page_of_rooms_is_linear_in_the_agents_rooms(store: RuntimeStore) -> None:
    """``parley rooms``: the agent's own row in each room read by its key, the page read in order."""
    agent_id = await new_agent(store)
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
    # Planned for its values, as the service runs it (not prepared: see the test of that below).
    plan = await explain(store.db, Q["list_rooms_admin"], values)
    for node in plan_nodes(plan):
        # Each room meets only its own agent row: nothing is compared with the others' rows.
        assert node.get("Rows Removed by Join Filter", 0) == 0, node
        if node.get("Relation Name") == "participant":
            assert node.get("Rows Removed by Filter", 0) == 0, node
            assert node["Actual Rows"] <= 1, node


async def test_the_embedding_backfill_reads_only_the_memories_waiting_for_one(store: RuntimeStore) -> None:
    agent_id = await new_agent(store)
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
        plan = await explain(store.db, Q["missing_embeddings"], {"agent_id": agent_id, "limit": 10})
        (scan,) = [n for n in plan_nodes(plan) if n.get("Relation Name") == "memory"]
        assert scan.get("Index Name") == "memory_missing_embedding", (analyzed, scan)
        assert scan.get("Rows Removed by Filter", 0) == 0, (analyzed, scan)
        assert scan["Actual Rows"] == 3, (analyzed, scan)


async def history_scan(store: RuntimeStore, sent: NewMessage) -> dict[str, Any]:
    """The plan node that reads the room's history in the ingest of ``sent``."""
    plan = await explain(store.db, Q["ingest"], params(sent))
    scans = [n for n in plan_nodes(plan) if n.get("Relation Name") == "memory" and n.get("Alias") == "m"]
    assert len(scans) == 1, scans
    return {k: v for k, v in scans[0].items() if k != "Plans"}


async def test_the_operators_pages_of_entities_and_participants_read_one_page(store: RuntimeStore) -> None:
    """``parley entities`` and ``parley participants``, newest first: a page walks an index in that
    order and stops, where it sorted every entity or participant of the agent (migration 0013)."""
    agent_id = await new_agent(store)
    users = 3000
    await store.db.execute(
        """WITH e AS (
               INSERT INTO runtime.entity (agent_id, id, names, created_at)
               SELECT %(agent)s, gen_random_uuid(), ARRAY['user ' || i],
                      now() - interval '1 hour' - i * interval '1 second'
                 FROM generate_series(1, %(users)s) AS i
               RETURNING id, created_at),
           r AS (
               INSERT INTO runtime.room (agent_id, id, source, channel_id, type)
               SELECT %(agent)s, gen_random_uuid(), 'history', 'channel-' || e.id, 'DM' FROM e
               RETURNING id, channel_id)
           INSERT INTO runtime.participant (agent_id, room_id, entity_id, created_at)
           SELECT %(agent)s, r.id, e.id, e.created_at
             FROM e JOIN r ON r.channel_id = 'channel-' || e.id""",
        {"agent": agent_id, "users": users},
        what="users",
    )
    entities = await store.db.fetchall(
        Q["list_entities"], {"agent_id": agent_id, "room_id": None, "limit": 51, "offset": 50}, what="page"
    )
    # The agent's own entity is the newest.
    assert [e["names"] for e in entities] == [[f"user {i}"] for i in range(50, 101)]
    participants = await store.db.fetchall(
        Q["list_participants"],
        {"agent_id": agent_id, "room_id": None, "entity_id": None, "limit": 51, "offset": 50},
        what="page",
    )
    assert [p["names"] for p in participants] == [[f"user {i}"] for i in range(51, 102)]

    # Once analyzed (autovacuum's statistics): with the statistics of before the 3,000 users, the
    # planner still believes a sort of a few rows is cheaper, as it did without the index.
    await store.db.execute("ANALYZE runtime.entity, runtime.participant", {}, what="analyze")
    for name, table, values in (
        ("list_entities", "entity", {"room_id": None}),
        ("list_participants", "participant", {"room_id": None, "entity_id": None}),
    ):
        await assert_reads_one_page(store.db, name, table, {"agent_id": agent_id, **values})


async def test_the_operators_pages_of_turns_and_relationships_read_one_page(store: RuntimeStore) -> None:
    """``parley turns`` (all the agent's turns, or one room's) and the relationships page, newest
    first: a page walks an index in that order and stops, where it sorted every turn or every
    relationship of the agent (migration 0014)."""
    agent_id = await new_agent(store)
    turns, rooms, users = 12000, 4, 400  # 3,000 turns a room: a sort of the room would read them all
    await store.db.execute(
        """WITH r AS (SELECT gen_random_uuid() AS id, n FROM generate_series(0, %(rooms)s - 1) AS n)
           INSERT INTO runtime.turn (agent_id, id, room_id, stream_seq, state, received_at)
           SELECT %(agent)s, gen_random_uuid(), r.id, i, 'replied', now() - i * interval '1 second'
             FROM generate_series(1, %(turns)s) AS i JOIN r ON r.n = i %% %(rooms)s""",
        {"agent": agent_id, "turns": turns, "rooms": rooms},
        what="turns",
    )
    await store.db.execute(
        """WITH e AS (
               INSERT INTO runtime.entity (agent_id, id, names)
               SELECT %(agent)s, gen_random_uuid(), ARRAY['user ' || i]
                 FROM generate_series(1, %(users)s) AS i
               RETURNING id, names)
           INSERT INTO runtime.relationship (agent_id, id, source_entity_id, target_entity_id, tags,
                                             updated_at)
           SELECT %(agent)s, gen_random_uuid(), e.id, %(agent)s, ARRAY[e.names[1]],
                  now() - substr(e.names[1], 6)::int * interval '1 second'
             FROM e""",
        {"agent": agent_id, "users": users},
        what="relationships",
    )
    await store.db.execute("ANALYZE runtime.turn, runtime.relationship", {}, what="analyze")

    everywhere = await store.list_turns(agent_id, None, 51, 50)
    assert [t.stream_seq for t in everywhere] == list(range(51, 102))
    room = everywhere[0].room_id
    in_room = await store.list_turns(agent_id, room, 51, 10)
    first = 51 % rooms  # the room's newest turn
    assert [t.stream_seq for t in in_room] == list(range(first + 10 * rooms, first + 61 * rooms, rooms))
    assert {t.room_id for t in in_room} == {room}
    relationships = await store.db.fetchall(
        Q["list_relationships"],
        {"agent_id": agent_id, "entity_id": None, "tag": None, "limit": 51, "offset": 50},
        what="page",
    )
    assert [r["tags"] for r in relationships] == [[f"user {i}"] for i in range(51, 102)]

    for name, table, values in (
        ("list_turns", "turn", {"room_id": None}),
        ("list_turns", "turn", {"room_id": room}),
        ("list_relationships", "relationship", {"entity_id": None, "tag": None}),
    ):
        await assert_reads_one_page(store.db, name, table, {"agent_id": agent_id, **values})


async def assert_reads_one_page(db: Database, name: str, table: str, values: dict[str, Any]) -> None:
    """The page at offset 50 walks an index in the page's order and stops after it: no sort, no row
    read and thrown away. Planned for its values, as the service runs its pages (not prepared)."""
    plan = await explain(db, Q[name], {**values, "limit": 51, "offset": 50})
    where = (name, values)
    sorts = [n for n in plan_nodes(plan) if n["Node Type"] in ("Sort", "Incremental Sort")]
    assert not sorts, where
    (scan,) = [n for n in plan_nodes(plan) if n.get("Relation Name") == table]
    assert scan["Actual Rows"] <= 101, (where, scan)
    assert scan.get("Rows Removed by Filter", 0) == 0, (where, scan)


async def test_the_operators_pages_are_planned_for_their_filters(test_env: SessionEnv) -> None:
    """The pages with optional filters (``%(room_id)s IS NULL OR room_id = …``) and a room's memory
    search are never prepared: a prepared statement may run PostgreSQL's one generic plan after five
    executions, and that plan cannot use the index of a filter that may be absent (one room's page
    of turns walked every turn of the agent). Counted in ``pg_prepared_statements`` of the pool's
    one connection, which does list the statements the store prepares."""
    async with runtime_store(test_env.database_url, "pages-unprepared", max_size=1) as store:
        agent_id = await new_agent(store)
        admin, documents = AdminStore(store.db), DocumentStore(store.db)
        room, entity = uuid.uuid4(), uuid.uuid4()
        before = await prepared_statements(store.db)
        assert await store.get_turn(agent_id, room) is None
        assert len(await prepared_statements(store.db)) == len(before) + 1
        for _ in range(7):
            for room_id in (None, room):
                await store.list_turns(agent_id, room_id, 51, 0)
                await store.list_memories(agent_id, "messages", room_id, 51, 0)
                await admin.list_entities(agent_id, room_id, 51, 0)
                await admin.list_participants(agent_id, room_id, entity, 51, 0)
                await admin.list_participants(agent_id, room_id, None, 51, 0)
                await admin.list_relationships(agent_id, entity if room_id else None, None, 51, 0)
                await admin.list_rooms_admin(agent_id, room_id, 51, 0)
            await store.search_memories(agent_id, [0.5] * 8, kind="facts", limit=5, room_id=room)
            await documents.page(agent_id, Requester(None, operator=True), room, 51, 0)
            await documents.page(agent_id, Requester(None, operator=True), None, 51, 0)
        assert len(await prepared_statements(store.db)) == len(before) + 1
        # The turn's own search, of the whole agent, is prepared.
        await store.search_memories(agent_id, [0.5] * 8, kind="facts", limit=5)
        assert len(await prepared_statements(store.db)) == len(before) + 2
