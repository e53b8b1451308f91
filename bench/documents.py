"""Document fragment search with authorization, against the same vector search without it.

One agent holds 2,000 documents of 50 fragments each (100,000 fragments, 384 dimensions, the
local embedding model's), in 20 rooms, with every scope and some direct grants. Measured, in
turns within one run so the machine's noise falls on both alike:

- the floor: the nearest 10 fragments of the agent by cosine distance, no authorization (the
  raw SQL of an exact vector search), and the same joined to the documents for their titles
  (``floor_with_titles``: what the search costs without the predicate);
- ``search_document_fragments`` (the runtime's statement, authorization in SQL) for the
  operator (everything readable), an entity that is OWNER of every room (everything but nothing
  agent-private), an ADMIN/MEMBER of a few rooms with some grants, a GUEST, and a stranger
  with grants only;

each reported as p50/p99 and as ratios to the floors'. Requesters who may read little are faster
than the floor: only the fragments of readable documents are ranked.

Usage: python bench/documents.py [--queries 60] [--documents 2000]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
import uuid

import psycopg
from _common import Series, bench_env, report

from parley_platform.postgres import migrate
from parley_runtime.store import MIGRATIONS_DIR, SCHEMA, Q

DOCUMENTS = 2_000
FRAGMENTS_PER_DOCUMENT = 50
DIMENSION = 384
ROOMS = 20
LIMIT = 10

PARTICIPANT = "INSERT INTO runtime.participant (agent_id, room_id, entity_id, role) VALUES (%s, %s, %s, %s)"
# The document join of search_document_fragments (for titles) without the authorization.
JOINED = """
WITH q AS (SELECT %(embedding)s::vector AS v)
SELECT f.document_id, f.position, f.text, d.title, 1 - (f.embedding <=> q.v) AS similarity
  FROM runtime.document_fragment f
  JOIN runtime.document d ON d.agent_id = f.agent_id AND d.id = f.document_id, q
 WHERE f.agent_id = %(agent_id)s::uuid AND vector_dims(f.embedding) = vector_dims(q.v)
 ORDER BY f.embedding <=> q.v, f.document_id, f.position
 LIMIT %(limit)s
"""
# The same vector search without authorization: no documents, no predicate.
FLOOR = """
WITH q AS (SELECT %(embedding)s::vector AS v)
SELECT f.document_id, f.position, f.text, 1 - (f.embedding <=> q.v) AS similarity
  FROM runtime.document_fragment f, q
 WHERE f.agent_id = %(agent_id)s::uuid AND vector_dims(f.embedding) = vector_dims(q.v)
 ORDER BY f.embedding <=> q.v, f.document_id, f.position
 LIMIT %(limit)s
"""


def ratio(a: float, b: float) -> float:
    return round(a / b, 3) if b else float("nan")


async def load(url: str, documents: int) -> tuple[uuid.UUID, dict[str, uuid.UUID | None]]:
    """The agent, its rooms, entities, participants, documents and fragments; the requesters."""
    agent = uuid.uuid4()
    rooms = [uuid.uuid4() for _ in range(ROOMS)]
    member, guest, stranger, owner = (uuid.uuid4() for _ in range(4))
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        await conn.execute(
            "INSERT INTO runtime.agent (id, name, character) VALUES (%s, %s, '{}')", (agent, f"bench-{agent}")
        )
        for entity in (agent, member, guest, stranger, owner):
            await conn.execute("INSERT INTO runtime.entity (agent_id, id) VALUES (%s, %s)", (agent, entity))
        for i, room in enumerate(rooms):
            await conn.execute(
                "INSERT INTO runtime.room (agent_id, id, source, channel_id, type)"
                " VALUES (%s, %s, 'b', %s, 'GROUP')",
                (agent, room, str(i)),
            )
            await conn.execute(
                PARTICIPANT,
                (agent, room, owner, "OWNER"),
            )
        for room, role in ((rooms[0], "ADMIN"), (rooms[1], "MEMBER"), (rooms[2], "MEMBER")):
            await conn.execute(
                PARTICIPANT,
                (agent, room, member, role),
            )
        await conn.execute(
            PARTICIPANT,
            (agent, rooms[4], guest, "GUEST"),
        )
        # Scopes round robin; user-private ones belong to the member; every 10th grants the member
        # and the stranger.
        await conn.execute(
            """
            INSERT INTO runtime.document (agent_id, id, room_id, scope, scoped_to_entity_id,
                                          direct_grant_entity_ids, title, content_type, text, size_bytes,
                                          fragment_count)
            SELECT %(agent)s, gen_random_uuid(), (%(rooms)s::uuid[])[1 + i %% %(n_rooms)s],
                   (ARRAY['global', 'owner-private', 'user-private', 'agent-private'])[1 + i %% 4],
                   CASE WHEN i %% 4 = 2 THEN %(member)s::uuid END,
                   CASE WHEN i %% 10 = 0 THEN ARRAY[%(member)s::uuid, %(stranger)s::uuid] ELSE '{}' END,
                   'doc ' || i, 'text/plain', 'text', 4, %(fragments)s
              FROM generate_series(1, %(documents)s) AS i
            """,
            {
                "agent": agent,
                "rooms": rooms,
                "n_rooms": ROOMS,
                "member": member,
                "stranger": stranger,
                "fragments": FRAGMENTS_PER_DOCUMENT,
                "documents": documents,
            },
        )
        await conn.execute(
            """
            INSERT INTO runtime.document_fragment (agent_id, document_id, position, text, embedding)
            SELECT d.agent_id, d.id, p,
                   'fragment ' || p || ' of ' || d.title,
                   (SELECT array_agg(random() - 0.5 + 0 * (p + g))
                      FROM generate_series(1, %(dimension)s) AS g)::vector
              FROM runtime.document d, generate_series(0, %(fragments)s - 1) AS p
             WHERE d.agent_id = %(agent)s
            """,
            {"agent": agent, "dimension": DIMENSION, "fragments": FRAGMENTS_PER_DOCUMENT},
        )
        await conn.execute("ANALYZE runtime.document")
        await conn.execute("ANALYZE runtime.document_fragment")
        await conn.execute("ANALYZE runtime.participant")
    return agent, {"operator": None, "owner": owner, "member": member, "guest": guest, "stranger": stranger}


async def main(args: argparse.Namespace) -> None:
    with bench_env() as env:
        await migrate(env.database_url, SCHEMA, MIGRATIONS_DIR)
        started = time.perf_counter()
        agent, requesters = await load(env.database_url, args.documents)
        fragments = args.documents * FRAGMENTS_PER_DOCUMENT
        print(f"loaded {fragments:,} fragments in {time.perf_counter() - started:.1f}s")
        rng = random.Random(7)
        names = ["floor", "floor_with_titles", *(f"authorized:{name}" for name in requesters)]
        latencies: dict[str, list[float]] = {name: [] for name in names}
        walls = dict.fromkeys(names, 0.0)
        readable_hits: dict[str, int] = {}
        async with await psycopg.AsyncConnection.connect(env.database_url, autocommit=True) as conn:

            async def run(name: str, sql: str, params: dict[str, object]) -> int:
                t0 = time.perf_counter()
                cur = await conn.execute(sql, params, prepare=True)
                rows = await cur.fetchall()
                took = time.perf_counter() - t0
                latencies[name].append(took)
                walls[name] += took
                return len(rows)

            for i in range(args.queries + 3):
                embedding = "[" + ",".join(repr(rng.uniform(-0.5, 0.5)) for _ in range(DIMENSION)) + "]"
                order = list(names)
                rng.shuffle(order)  # no measure always runs first (cache warm-up favours the later ones)
                for name in order:
                    if name.startswith("floor"):
                        sql = FLOOR if name == "floor" else JOINED
                        await run(name, sql, {"agent_id": agent, "embedding": embedding, "limit": LIMIT})
                        continue
                    requester = requesters[name.split(":", 1)[1]]
                    found = await run(
                        name,
                        Q["search_document_fragments"],
                        {
                            "agent_id": agent,
                            "requester": requester,
                            "operator": requester is None,
                            "embedding": embedding,
                            "limit": LIMIT,
                            "room_id": None,
                            "scopes": None,
                        },
                    )
                    readable_hits[name] = found
                if args.explain and i == 0:
                    for sql, requester in ((FLOOR, None), (Q["search_document_fragments"], None)):
                        params = {
                            "agent_id": agent,
                            "requester": requester,
                            "operator": True,
                            "embedding": embedding,
                            "limit": LIMIT,
                            "room_id": None,
                            "scopes": None,
                        }
                        cur = await conn.execute("EXPLAIN (ANALYZE, COSTS OFF) " + sql, params)
                        print("\n".join(str(r[0]) for r in await cur.fetchall()), end="\n\n")
                if i < 3:  # warm-up rounds are not measured
                    for name in names:
                        latencies[name].clear()
                        walls[name] = 0.0
        series = {name: Series(name, latencies[name], walls[name]) for name in names}
        floor = series["floor"]
        summary: dict[str, object] = {
            "benchmark": "documents",
            "fragments": fragments,
            "documents": args.documents,
            "dimension": DIMENSION,
            "limit": LIMIT,
            "queries": args.queries,
            "floor": floor.figures(),
            "authorized": {name: s.figures() for name, s in series.items() if not name.startswith("floor")},
            "hits": readable_hits,
        }
        joined = series["floor_with_titles"]
        summary["floor_with_titles"] = joined.figures()
        for name, s in series.items():
            if name.startswith("floor"):
                continue
            who = name.split(":", 1)[1]
            summary[f"{who}_p50_ratio_to_floor"] = ratio(s.p50_ms, floor.p50_ms)
            summary[f"{who}_p99_ratio_to_floor"] = ratio(s.p99_ms, floor.p99_ms)
            summary[f"{who}_p50_ratio_to_floor_with_titles"] = ratio(s.p50_ms, joined.p50_ms)
        report(
            f"Documents: fragment search over {fragments:,} fragments, "
            "with authorization in SQL, against the same search without it",
            list(series.values()),
            summary,
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--queries", type=int, default=60)
    parser.add_argument("--documents", type=int, default=DOCUMENTS, help="documents of the agent")
    parser.add_argument("--explain", action="store_true", help="print the plans of the floor and the search")
    asyncio.run(main(parser.parse_args()))
