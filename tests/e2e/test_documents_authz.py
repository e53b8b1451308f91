"""Documents (knowledge) against the real runtime, model gateway, NATS and PostgreSQL.

The read, change and re-grant rules of spec/runtime.md ("Documents (knowledge)") are checked as a
matrix: requesters of every kind (operator, the agent, OWNER, ADMIN, member, GUEST, NONE, direct
grantee, stranger, world roles; in the document's room or only in another) × scopes × rooms ×
grants, for listing, counting, reading, fragment search, adding, re-granting and removing. The
expected outcome of every cell comes from ``oracle`` below, written from the spec's text and
independent of the SQL. Then: grant replacement as a CAS raced by many connections, ingestion of
text, Markdown and PDF, and a real turn whose KNOWLEDGE provider shows only readable fragments.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import psycopg
import pytest
from psycopg.types.json import Jsonb

from parley.v1 import common_pb2, documents_pb2, runtime_pb2
from parley_platform.bus import Bus
from parley_platform.errors import Conflict, InvalidArgument, NotFound, PermissionDenied
from parley_platform.rpc import RpcClient
from parley_platform.testing import eventually
from parley_runtime import ids
from parley_runtime.documents.domain import PLAIN, chunk
from parley_runtime.store import Q
from support import SessionEnv, Suite, inbound, publish_inbound, replies_to

M = TypeVar("M")
SCOPES = {
    "global": documents_pb2.DOCUMENT_SCOPE_GLOBAL,
    "owner-private": documents_pb2.DOCUMENT_SCOPE_OWNER_PRIVATE,
    "user-private": documents_pb2.DOCUMENT_SCOPE_USER_PRIVATE,
    "agent-private": documents_pb2.DOCUMENT_SCOPE_AGENT_PRIVATE,
}
SCOPE_NAMES = {v: k for k, v in SCOPES.items()}


# -- the oracle: the spec's rules, written from its text ---------------------------------------------


@dataclass(frozen=True)
class Who:
    name: str
    entity: uuid.UUID | None  # None: the operator
    room_roles: dict[uuid.UUID, str] = field(default_factory=dict)  # participant role per room
    world_roles: dict[uuid.UUID, str] = field(default_factory=dict)  # role per world

    @property
    def requester(self) -> documents_pb2.Requester:
        if self.entity is None:
            return documents_pb2.Requester(operator=True)
        return documents_pb2.Requester(entity_id=str(self.entity))


@dataclass(frozen=True)
class Doc:
    room: uuid.UUID
    scope: str
    scoped_to: uuid.UUID | None
    grants: tuple[uuid.UUID, ...]


def oracle(
    action: str, who: Who, doc: Doc, *, agent: uuid.UUID, world_of: dict[uuid.UUID, uuid.UUID]
) -> bool:
    """May ``who`` read / mutate / grant ``doc``?

    - read: OWNER/AGENT always; a direct grantee reads anything but agent-private without room
      membership; GUEST only global in their rooms; others need the room, then global, or
      user-private when ADMIN or the scoped entity.
    - mutate: OWNER always; the agent only agent-private; others only in-room user-private as
      ADMIN or the scoped entity; grants never give mutation.
    - grant: OWNER, or an in-room ADMIN for global and user-private documents.
    The role is the participant role in the document's room, else the role in that room's world.
    """
    if who.entity is None:
        return True  # the operator acts as OWNER
    if who.entity == agent:
        return {"read": True, "mutate": doc.scope == "agent-private", "grant": False}[action]
    in_room = doc.room in who.room_roles
    role = who.room_roles.get(doc.room) or who.world_roles.get(world_of.get(doc.room, uuid.uuid4()))
    if role == "OWNER":
        return True
    mine = who.entity == doc.scoped_to
    if action == "read":
        if who.entity in doc.grants and doc.scope != "agent-private":
            return True
        if not in_room:
            return False
        if role == "GUEST":
            return doc.scope == "global"
        return doc.scope == "global" or (doc.scope == "user-private" and (role == "ADMIN" or mine))
    if action == "mutate":
        return in_room and role != "GUEST" and doc.scope == "user-private" and (role == "ADMIN" or mine)
    return in_room and role == "ADMIN" and doc.scope in ("global", "user-private")


# -- the world the matrix runs in ----------------------------------------------------------------------


@dataclass
class World:
    suite: Suite
    bus: Bus
    rpc: RpcClient
    agent: uuid.UUID
    name: str
    rooms: dict[str, uuid.UUID]
    world_of: dict[uuid.UUID, uuid.UUID]
    who: dict[str, Who]
    foreign_entity: uuid.UUID  # an entity of another agent

    async def call(self, method: str, request: Any, reply: type[M]) -> M:
        return await self.rpc.call("runtime", method, request, reply, timeout=30)

    async def add(self, who: Who, doc: Doc, text: str, title: str = "") -> documents_pb2.Document:
        return await self.call(
            "AddDocument",
            documents_pb2.AddDocumentRequest(
                agent_id=str(self.agent),
                requester=who.requester,
                room_id=str(doc.room),
                scope=SCOPES[doc.scope],
                scoped_to_entity_id=str(doc.scoped_to or ""),
                direct_grant_entity_ids=[str(g) for g in doc.grants],
                text=text,
                title=title,
            ),
            documents_pb2.Document,
        )

    async def remove_as_operator(self, document_id: str) -> None:
        await self.call(
            "RemoveDocument",
            documents_pb2.RemoveDocumentRequest(
                agent_id=str(self.agent), requester=self.who["operator"].requester, document_id=document_id
            ),
            documents_pb2.RemoveDocumentResponse,
        )

    def allowed(self, action: str, who: Who, doc: Doc) -> bool:
        return oracle(action, who, doc, agent=self.agent, world_of=self.world_of)


async def _upsert_agent(rpc: RpcClient, name: str) -> uuid.UUID:
    character = {"name": name, "bio": ["An agent with documents."], "system": "You are a test agent."}
    agent = await rpc.call(
        "runtime",
        "UpsertAgent",
        runtime_pb2.UpsertAgentRequest(character=json.dumps(character)),
        runtime_pb2.Agent,
        timeout=30,
    )
    return uuid.UUID(agent.id)


@pytest.fixture(scope="module")
async def world(test_env: SessionEnv, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[World]:
    suite = Suite(test_env, tmp_path_factory.mktemp("documents"), f"d{secrets.token_hex(4)}")
    try:
        await suite.start(PARLEY_TRAJECTORY_LOGGING="true")
        bus = await suite.connect()
        rpc = RpcClient(bus)
        name = f"docs-{secrets.token_hex(4)}"
        agent = await _upsert_agent(rpc, name)
        other_agent = await _upsert_agent(rpc, f"docs-other-{secrets.token_hex(4)}")
        rooms = {
            "R1": ids.room_id(agent, "e2e", f"docs-r1-{name}"),
            "R2": ids.room_id(agent, "e2e", f"docs-r2-{name}"),
        }
        w1 = ids.world_id(agent, "e2e", f"docs-w1-{name}")
        names = [
            "owner1", "owner2", "admin1", "admin2", "member1", "member2", "guest1", "none1",
            "grantee", "stranger", "world_owner", "world_admin",
        ]  # fmt: skip
        entity = {n: ids.entity_id(agent, "e2e", f"{n}-{name}") for n in names}
        r1, r2 = rooms["R1"], rooms["R2"]
        participants = {
            "owner1": {r1: "OWNER"},
            "owner2": {r2: "OWNER"},
            "admin1": {r1: "ADMIN"},
            "admin2": {r2: "ADMIN"},
            "member1": {r1: "MEMBER"},
            "member2": {r2: "MEMBER"},
            "guest1": {r1: "GUEST"},
            "none1": {r1: "NONE"},
            "world_admin": {r1: "MEMBER"},  # a MEMBER here: the room's participant role comes first
        }
        world_roles = {"world_owner": {w1: "OWNER"}, "world_admin": {w1: "ADMIN"}, "member2": {w1: "ADMIN"}}
        foreign = ids.entity_id(other_agent, "e2e", "foreigner")
        with psycopg.connect(test_env.database_url, autocommit=True) as conn:
            conn.execute(
                "INSERT INTO runtime.world (agent_id, id, source, external_id, metadata)"
                " VALUES (%s, %s, 'e2e', %s, %s)",
                (agent, w1, "w1", Jsonb({"roles": {str(entity[n]): r[w1] for n, r in world_roles.items()}})),
            )
            for key, room in rooms.items():
                conn.execute(
                    "INSERT INTO runtime.room (agent_id, id, world_id, source, channel_id, type)"
                    " VALUES (%s, %s, %s, 'e2e', %s, 'GROUP')",
                    (agent, room, w1 if key == "R1" else None, f"docs-{key}-{name}"),
                )
            for n, e in entity.items():
                conn.execute(
                    "INSERT INTO runtime.entity (agent_id, id, names) VALUES (%s, %s, %s)", (agent, e, [n])
                )
                for room, role in participants.get(n, {}).items():
                    conn.execute(
                        "INSERT INTO runtime.participant (agent_id, room_id, entity_id, role)"
                        " VALUES (%s, %s, %s, %s)",
                        (agent, room, e, role),
                    )
            conn.execute(
                "INSERT INTO runtime.entity (agent_id, id, names) VALUES (%s, %s, %s)",
                (other_agent, foreign, ["x"]),
            )
        who = {
            "operator": Who("operator", None),
            "agent": Who("agent", agent),
            **{n: Who(n, entity[n], participants.get(n, {}), world_roles.get(n, {})) for n in names},
        }
        yield World(suite, bus, rpc, agent, name, rooms, {r1: w1}, who, foreign)
        await bus.close()
    finally:
        suite.stop()


def templates(w: World) -> list[Doc]:
    """Every scope in both rooms, with no grants, a grant to the grantee, or grants to a mix."""
    e = {n: who.entity for n, who in w.who.items()}
    grant_sets: list[tuple[uuid.UUID, ...]] = [
        (),
        (e["grantee"],),  # type: ignore[arg-type]
        (e["guest1"], e["member2"], e["stranger"]),  # type: ignore[arg-type]
    ]
    docs = []
    for room in w.rooms.values():
        for scope in SCOPES:
            owners = [e["member1"], e["guest1"], e["member2"]] if scope == "user-private" else [None]
            for scoped_to in owners:
                for grants in grant_sets:
                    docs.append(Doc(room, scope, scoped_to, grants))
    return docs


async def _outcome(call: Awaitable[Any]) -> str:
    try:
        await call
    except NotFound as exc:
        return "not_found" if exc.code == "DOCUMENT_NOT_FOUND" else f"not_found:{exc.code}"
    except PermissionDenied:
        return "denied"
    return "ok"


async def gather_limited(calls: list[Callable[[], Awaitable[M]]], limit: int = 16) -> list[M]:
    slots = asyncio.Semaphore(limit)

    async def one(call: Callable[[], Awaitable[M]]) -> M:
        async with slots:
            return await call()

    return list(await asyncio.gather(*(one(c) for c in calls)))


# -- reading: rows, counts, documents and fragment rankings --------------------------------------------


async def test_reads_lists_counts_and_search_follow_the_rules(world: World) -> None:
    w = world
    docs = templates(w)
    operator = w.who["operator"]
    added = await gather_limited(
        [
            lambda d=d, i=i: w.add(operator, d, f"shared words about the topic number {i}")
            for i, d in enumerate(docs)
        ]
    )
    by_id = {a.id: d for a, d in zip(added, docs, strict=True)}
    missing = str(uuid.uuid4())
    cells = 0
    try:
        for who in w.who.values():
            expected = {i for i, d in by_id.items() if w.allowed("read", who, d)}
            listed: list[str] = []
            offset = 0
            while True:  # pages of 7: newest first, id breaks ties, the same total on each page
                page = await w.call(
                    "ListDocuments",
                    documents_pb2.ListDocumentsRequest(
                        agent_id=str(w.agent),
                        requester=who.requester,
                        page=common_pb2.PageRequest(limit=7, offset=offset),
                    ),
                    documents_pb2.ListDocumentsResponse,
                )
                assert page.total == len(expected), who.name
                listed += [d.id for d in page.documents]
                if not page.page.has_more:
                    break
                offset = page.page.next_offset
            assert set(listed) == expected, who.name
            assert len(listed) == len(expected)
            keys = [(d.created_at.ToDatetime(), d.id) for d in (await _get_all(w, who, listed))]
            assert keys == sorted(keys, reverse=True), who.name

            r1 = await w.call(
                "ListDocuments",
                documents_pb2.ListDocumentsRequest(
                    agent_id=str(w.agent), requester=who.requester, room_id=str(w.rooms["R1"])
                ),
                documents_pb2.ListDocumentsResponse,
            )
            assert {d.id for d in r1.documents} == {i for i in expected if by_id[i].room == w.rooms["R1"]}
            assert r1.total == len(r1.documents)

            found = await w.call(
                "SearchDocuments",
                documents_pb2.SearchDocumentsRequest(
                    agent_id=str(w.agent),
                    requester=who.requester,
                    query="shared words about the topic",
                    limit=100,
                ),
                documents_pb2.SearchDocumentsResponse,
            )
            assert {f.document_id for f in found.fragments} == expected, who.name
            similarities = [f.similarity for f in found.fragments]
            assert similarities == sorted(similarities, reverse=True)

            outcomes = await gather_limited(
                [
                    lambda i=i, who=who: _outcome(
                        w.call(
                            "GetDocument",
                            documents_pb2.GetDocumentRequest(
                                agent_id=str(w.agent), requester=who.requester, document_id=i
                            ),
                            documents_pb2.Document,
                        )
                    )
                    for i in by_id
                ]
            )
            for i, outcome in zip(by_id, outcomes, strict=True):
                assert outcome == ("ok" if i in expected else "not_found"), (who.name, by_id[i])
                cells += 1
            # An unreadable document answers exactly like a missing one.
            with pytest.raises(NotFound) as absent:
                await w.call(
                    "GetDocument",
                    documents_pb2.GetDocumentRequest(
                        agent_id=str(w.agent), requester=who.requester, document_id=missing
                    ),
                    documents_pb2.Document,
                )
            hidden = [i for i in by_id if i not in expected]
            if hidden:
                with pytest.raises(NotFound) as unreadable:
                    await w.call(
                        "GetDocument",
                        documents_pb2.GetDocumentRequest(
                            agent_id=str(w.agent), requester=who.requester, document_id=hidden[0]
                        ),
                        documents_pb2.Document,
                    )
                assert (unreadable.value.code, unreadable.value.hint) == (
                    absent.value.code,
                    absent.value.hint,
                )
                assert unreadable.value.message == absent.value.message.replace(missing, hidden[0])
    finally:
        await gather_limited([lambda i=i: w.remove_as_operator(i) for i in by_id])
    assert cells == len(w.who) * len(docs)


async def _get_all(w: World, who: Who, document_ids: list[str]) -> list[documents_pb2.Document]:
    return await gather_limited(
        [
            lambda i=i: w.call(
                "GetDocument",
                documents_pb2.GetDocumentRequest(
                    agent_id=str(w.agent), requester=who.requester, document_id=i
                ),
                documents_pb2.Document,
            )
            for i in document_ids
        ]
    )


# -- changing: add, re-grant, remove ------------------------------------------------------------------------


async def test_adding_regranting_and_removing_follow_the_rules(world: World) -> None:
    w = world
    operator = w.who["operator"]
    docs = templates(w)
    cells = 0
    for who in w.who.values():
        # Add: allowed when the requester may change such a document (and re-grant it, with grants).
        async def try_add(d: Doc, who: Who = who) -> tuple[Doc, str, str]:
            try:
                added = await w.add(who, d, "a document added by the matrix")
            except PermissionDenied:
                return d, "denied", ""
            return d, "ok", added.id

        results = await gather_limited([lambda d=d: try_add(d) for d in docs])
        for d, outcome, _ in results:
            allowed = w.allowed("mutate", who, d) and (not d.grants or w.allowed("grant", who, d))
            assert outcome == ("ok" if allowed else "denied"), (who.name, d)
            cells += 1
        await gather_limited(
            [lambda i=i: w.remove_as_operator(i) for _, outcome, i in results if outcome == "ok"]
        )

        # Re-grant then remove a copy of each document, as this requester.
        copies = await gather_limited(
            [lambda d=d: w.add(operator, d, "a copy for the change matrix") for d in docs]
        )

        async def change(copy: documents_pb2.Document, d: Doc, who: Who = who) -> tuple[str, str]:
            regrant = await _outcome(
                w.call(
                    "ReplaceDocumentGrants",
                    documents_pb2.ReplaceDocumentGrantsRequest(
                        agent_id=str(w.agent),
                        requester=who.requester,
                        document_id=copy.id,
                        expected_access_revision=copy.access_revision,
                        direct_grant_entity_ids=copy.direct_grant_entity_ids,
                    ),
                    documents_pb2.Document,
                )
            )
            remove = await _outcome(
                w.call(
                    "RemoveDocument",
                    documents_pb2.RemoveDocumentRequest(
                        agent_id=str(w.agent), requester=who.requester, document_id=copy.id
                    ),
                    documents_pb2.RemoveDocumentResponse,
                )
            )
            return regrant, remove

        changes = await gather_limited(
            [lambda c=c, d=d: change(c, d) for c, d in zip(copies, docs, strict=True)]
        )
        for copy, d, (regrant, remove) in zip(copies, docs, changes, strict=True):
            readable = w.allowed("read", who, d)
            want_grant = "ok" if w.allowed("grant", who, d) else ("denied" if readable else "not_found")
            want_remove = "ok" if w.allowed("mutate", who, d) else ("denied" if readable else "not_found")
            assert (regrant, remove) == (want_grant, want_remove), (who.name, d)
            if remove != "ok":
                await w.remove_as_operator(copy.id)
            cells += 2
    assert cells == 3 * len(w.who) * len(docs)


async def test_invalid_grants_and_pages_fail_closed(world: World) -> None:
    w = world
    operator = w.who["operator"]
    r1 = w.rooms["R1"]
    doc = await w.add(operator, Doc(r1, "global", None, ()), "a document whose grants are tried")
    grantee = str(w.who["grantee"].entity)

    async def regrant(grants: list[str], who: Who = operator, revision: int = 0) -> documents_pb2.Document:
        return await w.call(
            "ReplaceDocumentGrants",
            documents_pb2.ReplaceDocumentGrantsRequest(
                agent_id=str(w.agent),
                requester=who.requester,
                document_id=doc.id,
                expected_access_revision=revision or doc.access_revision,
                direct_grant_entity_ids=grants,
            ),
            documents_pb2.Document,
        )

    bad = {
        "UNKNOWN_ENTITY": [grantee, str(w.foreign_entity)],  # another agent's entity
        "DUPLICATE_GRANTS": [grantee, grantee],
        "TOO_MANY_GRANTS": [str(uuid.uuid4()) for _ in range(1001)],
        "INVALID_ID": ["not-a-uuid"],
    }
    for code, grants in bad.items():
        with pytest.raises(InvalidArgument) as refused:
            await regrant(grants)
        assert refused.value.code == code
    unknown = str(uuid.uuid4())
    with pytest.raises(InvalidArgument):
        await regrant([unknown])
    with pytest.raises(InvalidArgument) as foreign_add:
        await w.add(operator, Doc(r1, "global", None, (w.foreign_entity,)), "foreign grant")
    assert foreign_add.value.code == "UNKNOWN_ENTITY"
    after = await w.call(
        "GetDocument",
        documents_pb2.GetDocumentRequest(
            agent_id=str(w.agent), requester=operator.requester, document_id=doc.id
        ),
        documents_pb2.Document,
    )
    assert after.access_revision == doc.access_revision
    assert not after.direct_grant_entity_ids

    # 1000 grants of this agent's entities are fine; the database refuses duplicates by itself too.
    many = [uuid.uuid4() for _ in range(999)]
    with psycopg.connect(w.suite.env.database_url, autocommit=True) as conn:
        with conn.cursor() as cur:
            cur.executemany(
                "INSERT INTO runtime.entity (agent_id, id) VALUES (%s, %s)", [(w.agent, e) for e in many]
            )
        with pytest.raises(psycopg.errors.CheckViolation):
            conn.execute(
                "UPDATE runtime.document SET direct_grant_entity_ids = %s WHERE agent_id = %s AND id = %s",
                ([many[0], many[0]], w.agent, doc.id),
            )
    granted = await regrant([grantee, *map(str, many)])
    assert len(granted.direct_grant_entity_ids) == 1000
    assert granted.access_revision == doc.access_revision + 1
    with pytest.raises(Conflict) as stale:
        await regrant([grantee])  # the old revision
    assert stale.value.code == "ACCESS_REVISION_CHANGED"

    for limit, offset in ((101, 0), (-1, 0), (10, -1)):
        with pytest.raises(InvalidArgument) as bad_page:
            await w.call(
                "ListDocuments",
                documents_pb2.ListDocumentsRequest(
                    agent_id=str(w.agent),
                    requester=operator.requester,
                    page=common_pb2.PageRequest(limit=limit, offset=offset),
                ),
                documents_pb2.ListDocumentsResponse,
            )
        assert bad_page.value.code == "INVALID_PAGE"
    for limit in (101, -5):
        with pytest.raises(InvalidArgument):
            await w.call(
                "SearchDocuments",
                documents_pb2.SearchDocumentsRequest(
                    agent_id=str(w.agent), requester=operator.requester, query="x", limit=limit
                ),
                documents_pb2.SearchDocumentsResponse,
            )
    with pytest.raises(InvalidArgument) as nobody:
        await w.call(
            "ListDocuments",
            documents_pb2.ListDocumentsRequest(agent_id=str(w.agent)),
            documents_pb2.ListDocumentsResponse,
        )
    assert nobody.value.code == "REQUESTER_REQUIRED"
    await w.remove_as_operator(doc.id)


# -- grant replacement is a CAS: one winner among many -----------------------------------------------------


async def test_racing_grant_replacements_have_exactly_one_winner(world: World) -> None:
    w = world
    operator, admin = w.who["operator"], w.who["admin1"]
    url = w.suite.env.database_url
    doc = await w.add(operator, Doc(w.rooms["R1"], "global", None, ()), "a document raced for")
    racers = 16
    candidates = [w.who[n].entity for n in ("grantee", "stranger", "member1", "guest1")]

    # Separate connections, all queued behind a lock on the row, then released at once.
    blocker = await psycopg.AsyncConnection.connect(url)
    conns = [await psycopg.AsyncConnection.connect(url, autocommit=True) for _ in range(racers)]
    try:
        await blocker.execute(
            "SELECT 1 FROM runtime.document WHERE agent_id = %s AND id = %s FOR UPDATE",
            (w.agent, uuid.UUID(doc.id)),
        )

        async def race(conn: psycopg.AsyncConnection[Any], i: int) -> bool:
            cur = await conn.execute(
                Q["replace_document_grants"],
                {
                    "agent_id": w.agent,
                    "requester": admin.entity,
                    "operator": False,
                    "id": uuid.UUID(doc.id),
                    "expected": doc.access_revision,
                    "grants": [candidates[i % len(candidates)]],
                },
            )
            row = await cur.fetchone()
            assert row is not None
            return row[4] is not None  # updated.agent_id: this statement changed the row

        tasks = [asyncio.create_task(race(c, i)) for i, c in enumerate(conns)]

        async def all_waiting() -> bool:
            async with await psycopg.AsyncConnection.connect(url) as watcher:
                cur = await watcher.execute(
                    "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
                    " AND wait_event_type = 'Lock' AND query LIKE '%%UPDATE runtime.document%%'"
                )
                row = await cur.fetchone()
                return row is not None and row[0] == racers

        await eventually(all_waiting, timeout=20, what="every racer waiting on the row")
        await blocker.commit()
        winners = sum(await asyncio.gather(*tasks))
    finally:
        await blocker.close()
        for c in conns:
            await c.close()
    assert winners == 1
    after = await w.call(
        "GetDocument",
        documents_pb2.GetDocumentRequest(
            agent_id=str(w.agent), requester=operator.requester, document_id=doc.id
        ),
        documents_pb2.Document,
    )
    assert after.access_revision == doc.access_revision + 1

    # The same over the API: concurrent requests with one revision, one success, the rest ABORTED.
    async def api_race(i: int) -> str:
        try:
            await w.call(
                "ReplaceDocumentGrants",
                documents_pb2.ReplaceDocumentGrantsRequest(
                    agent_id=str(w.agent),
                    requester=admin.requester,
                    document_id=doc.id,
                    expected_access_revision=after.access_revision,
                    direct_grant_entity_ids=[str(candidates[i % len(candidates)])],
                ),
                documents_pb2.Document,
            )
        except Conflict as exc:
            if exc.code != "ACCESS_REVISION_CHANGED":
                return f"conflict:{exc.code}"
            # A loser is told the revision the winner left, never its own stale snapshot.
            told = f"has access revision {after.access_revision + 1}, not {after.access_revision}"
            return "lost" if told in str(exc) else f"lost, told: {exc}"
        return "won"

    outcomes = await asyncio.gather(*(api_race(i) for i in range(racers)))
    assert outcomes.count("won") == 1
    assert outcomes.count("lost") == racers - 1

    # Concurrent removals by the operator: one removes it, the others find nothing (NOT_FOUND,
    # not a refusal: they could have removed it).
    async def remove() -> str:
        try:
            await w.remove_as_operator(doc.id)
        except NotFound as exc:
            return exc.code
        return "removed"

    removals = await asyncio.gather(*(remove() for _ in range(8)))
    assert sorted(removals) == ["DOCUMENT_NOT_FOUND"] * 7 + ["removed"]


# -- ingestion ----------------------------------------------------------------------------------------------


def tiny_pdf(lines: list[str]) -> bytes:
    """A one-page PDF with these lines in Helvetica, with a correct cross-reference table."""
    text = " ".join(f"({line}) Tj 0 -16 Td" for line in lines)
    stream = f"BT /F1 12 Tf 72 720 Td {text} ET".encode()
    objects = [
        b"<< /Type /Catalog /Pages 2 0 R >>",
        b"<< /Type /Pages /Kids [3 0 R] /Count 1 >>",
        b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Contents 4 0 R"
        b" /Resources << /Font << /F1 5 0 R >> >> >>",
        b"<< /Length %d >>\nstream\n" % len(stream) + stream + b"\nendstream",
        b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>",
    ]
    out = bytearray(b"%PDF-1.4\n")
    offsets = []
    for number, body in enumerate(objects, start=1):
        offsets.append(len(out))
        out += b"%d 0 obj\n" % number + body + b"\nendobj\n"
    xref = len(out)
    out += b"xref\n0 %d\n0000000000 65535 f \n" % (len(objects) + 1)
    out += b"".join(b"%010d 00000 n \n" % o for o in offsets)
    out += b"trailer\n<< /Size %d /Root 1 0 R >>\nstartxref\n%d\n%%%%EOF\n" % (len(objects) + 1, xref)
    return bytes(out)


async def test_text_markdown_and_pdf_are_ingested_into_searchable_fragments(world: World) -> None:
    w = world
    operator = w.who["operator"]

    async def add_file(content: bytes, file_name: str) -> documents_pb2.Document:
        return await w.call(
            "AddDocument",
            documents_pb2.AddDocumentRequest(
                agent_id=str(w.agent), requester=operator.requester, content=content, file_name=file_name
            ),
            documents_pb2.Document,
        )

    async def search(query: str) -> list[documents_pb2.DocumentFragment]:
        found = await w.call(
            "SearchDocuments",
            documents_pb2.SearchDocumentsRequest(
                agent_id=str(w.agent), requester=operator.requester, query=query, limit=3
            ),
            documents_pb2.SearchDocumentsResponse,
        )
        return list(found.fragments)

    paragraphs = [
        f"Paragraph {i} tells of the lighthouse keeper and the storm number {i}." * 4 for i in range(40)
    ]
    plain = await add_file("\n\n".join(paragraphs).encode(), "keeper.txt")
    assert plain.content_type == "text/plain"
    assert plain.title == "keeper.txt"
    assert plain.fragment_count == len(chunk("\n\n".join(paragraphs), PLAIN)) > 1

    markdown_text = "# Orchards\n\nApples grow in rows.\n\n## Pruning\n\nCut the quince trees in winter.\n"
    markdown = await add_file(markdown_text.encode(), "orchard.md")
    assert markdown.content_type == "text/markdown"
    assert markdown.fragment_count == 2
    [hit, *_] = await search("quince trees winter")
    assert hit.document_id == markdown.id
    assert hit.text.startswith("Pruning\n")
    assert "quince" in hit.text

    pdf = await add_file(tiny_pdf(["The zebra sleeps standing up.", "Kiwis cannot fly."]), "animals.pdf")
    assert pdf.content_type == "application/pdf"
    shown = await w.call(
        "GetDocument",
        documents_pb2.GetDocumentRequest(
            agent_id=str(w.agent), requester=operator.requester, document_id=pdf.id, include_text=True
        ),
        documents_pb2.Document,
    )
    assert "zebra sleeps standing" in shown.text
    assert "Kiwis cannot fly" in shown.text
    [hit, *_] = await search("zebra sleeps standing")
    assert hit.document_id == pdf.id

    text = await w.add(operator, Doc(w.rooms["R1"], "global", None, ()), "Plain words given as text.", "Note")
    assert (text.title, text.content_type, text.fragment_count) == ("Note", "text/plain", 1)

    with pytest.raises(InvalidArgument) as not_pdf:
        await add_file(b"%PDF-1.4 but nothing else", "broken.pdf")
    assert not_pdf.value.code == "PDF_UNREADABLE"
    with pytest.raises(InvalidArgument) as odd:
        await add_file(b"\x00\x01", "archive.zip")
    assert odd.value.code == "UNSUPPORTED_CONTENT_TYPE"
    for doc in (plain, markdown, pdf, text):
        await w.remove_as_operator(doc.id)


# -- a real turn: the KNOWLEDGE provider shows only what the sender may read ---------------------------------


async def test_the_knowledge_provider_only_surfaces_readable_fragments_in_a_turn(world: World) -> None:
    w = world
    operator = w.who["operator"]
    channel = f"kb-{secrets.token_hex(4)}"
    room = ids.room_id(w.agent, "e2e", channel)
    alice, bob = (ids.entity_id(w.agent, "e2e", n) for n in ("alice", "bob"))
    with psycopg.connect(w.suite.env.database_url, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO runtime.room (agent_id, id, source, channel_id, type)"
            " VALUES (%s, %s, 'e2e', %s, 'API')",
            (w.agent, room, channel),
        )
        for entity, name in ((alice, "alice"), (bob, "bob")):
            conn.execute(
                "INSERT INTO runtime.entity (agent_id, id, names) VALUES (%s, %s, %s) ON CONFLICT DO NOTHING",
                (w.agent, entity, [name.title()]),
            )
            conn.execute(
                "INSERT INTO runtime.participant (agent_id, room_id, entity_id, role)"
                " VALUES (%s, %s, %s, 'MEMBER')",
                (w.agent, room, entity),
            )
    words = {
        "heliotrope": Doc(room, "global", None, ()),
        "marigold": Doc(room, "user-private", alice, ()),
        "obsidian": Doc(room, "owner-private", None, ()),
        "zeppelin": Doc(room, "agent-private", None, ()),
        "tangerine": Doc(w.rooms["R2"], "global", None, ()),
        "saffron": Doc(w.rooms["R2"], "global", None, (bob,)),
    }
    added = [await w.add(operator, d, f"The secret code word is {word}.", word) for word, d in words.items()]
    # In a room of one person with the agent (API), everything the sender may read; in a shared
    # room (GROUP), only the room's global documents: nothing private to one participant is quoted
    # to the others.
    readable = [
        ("bob", runtime_pb2.ROOM_TYPE_API, {"heliotrope", "saffron"}),
        ("alice", runtime_pb2.ROOM_TYPE_API, {"heliotrope", "marigold"}),
        ("bob", runtime_pb2.ROOM_TYPE_GROUP, {"heliotrope"}),
        ("alice", runtime_pb2.ROOM_TYPE_GROUP, {"heliotrope"}),
    ]
    try:
        for sender, room_type, expected in readable:
            message = inbound(
                "what is the secret code word", channel=channel, sender=sender, agent_id=str(w.agent)
            )
            message.room_type = room_type
            message.mentions_agent = True
            await publish_inbound(w.bus, message)

            async def replied(m: runtime_pb2.InboundMessage = message) -> list[runtime_pb2.OutboundMessage]:
                return await replies_to(w.bus, m)

            await eventually(replied, timeout=30, what=f"the reply to {sender}")
            turn_id = ids.message_id(w.agent, "e2e", message.message_id)

            def trajectory(turn: uuid.UUID = turn_id) -> dict[str, Any]:
                with psycopg.connect(w.suite.env.database_url) as conn:
                    row = conn.execute(
                        "SELECT trajectory FROM runtime.turn WHERE agent_id = %s AND id = %s", (w.agent, turn)
                    ).fetchone()
                assert row is not None
                assert row[0] is not None
                return dict(row[0])

            knowledge = trajectory()["providers"].get("KNOWLEDGE", "")
            shown = {word for word in words if word in knowledge}
            assert shown == expected, (sender, knowledge)
            assert knowledge.startswith("# Knowledge\n")
    finally:
        for doc in added:
            await w.remove_as_operator(doc.id)


# -- the operator's command line ------------------------------------------------------------------------


def _parley(suite: Suite, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PARLEY_")}
    env.update(
        PARLEY_NATS_URL=suite.env.nats_url,
        PARLEY_NAMESPACE=suite.namespace,
        PARLEY_OPERATOR_TOKEN=suite.env.token,
        PARLEY_RUNTIME_ADDR=f"127.0.0.1:{suite.runtime.grpc_port}",
    )
    parley = str(Path(sys.executable).parent / "parley")
    return subprocess.run([parley, *args], env=env, capture_output=True, text=True, timeout=60, check=False)


async def test_parley_docs_add_list_show_search_grant_remove(world: World, tmp_path: Path) -> None:
    w = world

    async def parley(*args: str) -> str:
        result = await asyncio.to_thread(_parley, w.suite, *args, "--agent", w.name)
        assert result.returncode == 0, result.stderr
        return result.stdout

    notes = tmp_path / "notes.md"
    notes.write_text("# Bees\n\nBees dance to tell where the flowers are.\n")
    added = await parley("docs", "add", str(notes), "--room", str(w.rooms["R1"]))
    doc_id = added.split()[1]
    assert "notes.md" in added
    assert "1 fragments" in added
    listed = await parley("docs", "list", "--limit", "100")
    assert doc_id in listed
    shown = await parley("docs", "show", doc_id, "--text")
    assert "Bees dance to tell where the flowers are." in shown
    assert "access revision 1" in shown
    found = await parley("docs", "search", "where do bees dance")
    assert "notes.md #0" in found.splitlines()[0]
    granted = await parley(
        "docs", "grant", doc_id, "--revision", "1", "--entity", str(w.who["grantee"].entity)
    )
    assert "1 entities, access revision 2" in granted
    text_doc = await parley("docs", "add", "--text", "a note given as text", "--title", "Inline")
    assert "Inline" in text_doc
    for document_id in (doc_id, text_doc.split()[1]):
        removed = await parley("docs", "remove", document_id)
        assert f"removed: {document_id}" in removed
    missing = await asyncio.to_thread(_parley, w.suite, "docs", "show", doc_id, "--agent", w.name)
    assert missing.returncode == 1
    assert "no document" in missing.stderr
