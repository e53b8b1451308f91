"""The evaluators of a turn through the model gateway's prompt batcher, as real processes: REFLECTION
and a plugin's TOPIC evaluator are two sections of the turn's room affinity answered by ONE model
call, and REFLECTION stores facts, a tagged relationship between two entities and a reflection."""

from __future__ import annotations

import asyncio
import json
import secrets
import time
import uuid
from pathlib import Path
from typing import Any

import psycopg

from parley.v1 import runtime_pb2
from parley_runtime import ids
from support import ROOT, Suite, inbound, publish_inbound, replies_to

AGENT = "evaltester"
CHARACTER = f"""name: {AGENT}
system: You are a test agent.
plugins: ["plugins.evaluator_fixtures:evaluator_plugin"]
settings: {{REFLECTION_INTERVAL: 1}}  # REFLECTION after every message of four words or more
"""


def _rows(url: str, sql: str, *params: Any) -> list[tuple[Any, ...]]:
    with psycopg.connect(url) as conn:
        return conn.execute(sql, params).fetchall()


async def _until(check: Any, what: str, timeout: float = 30) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = check()
        if found:
            return found
        await asyncio.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


async def test_reflection_and_a_plugin_evaluator_share_one_batched_call(
    isolated_suite: Suite, tmp_path: Path
) -> None:
    characters = tmp_path / "characters"
    characters.mkdir()
    (characters / "evaltester.yaml").write_text(CHARACTER)
    log = tmp_path / "fixtures.log"
    log.touch()
    suite = await isolated_suite.start(
        PARLEY_CHARACTERS_DIR=str(characters),
        PARLEY_TRAJECTORY_LOGGING="true",
        PYTHONPATH=str(ROOT / "tests"),
        FIXTURE_LOG=str(log),
        PARLEY_EVALUATOR_BATCH_WINDOW_MS="200",
    )
    agent_id = str(ids.agent_id(AGENT))
    url = suite.env.database_url
    channel = f"family-{secrets.token_hex(3)}"
    bus = await suite.connect()
    try:

        async def say(sender: str, text: str) -> runtime_pb2.InboundMessage:
            message = inbound(
                text, agent_id=agent_id, sender=sender, channel=channel, room_type=runtime_pb2.ROOM_TYPE_GROUP
            )
            message.mentions_agent = True
            await publish_inbound(bus, message)
            return message

        bob = await say("bob", "Bob here, hi")
        await _until(lambda: "TOPIC" in log.read_text(), "Bob's TOPIC evaluator")
        alice = await say("alice", "Bob is my brother and he lives in Oslo")
        alice_id = ids.message_id(uuid.UUID(agent_id), "e2e", alice.message_id)
        await _until(lambda: f"TOPIC {alice_id} " in log.read_text(), "Alice's TOPIC evaluator")
        fallback = await say("alice", "please fall back on the topic")
        for message in (bob, alice, fallback):
            for _ in range(150):
                if await replies_to(bus, message):
                    break
                await asyncio.sleep(0.2)
            assert await replies_to(bus, message), message.text
    finally:
        await bus.close()

    assert f"TOPIC {alice_id} family False" in log.read_text()

    # One drain of the room's affinity answered both sections of Alice's turn with one model call.
    [(room_id,)] = _rows(
        url, "SELECT room_id FROM runtime.memory WHERE agent_id = %s AND id = %s", agent_id, alice_id
    )
    drains = _rows(
        url,
        "SELECT sections, calls FROM model.batch_drain WHERE affinity = %s ORDER BY seq",
        f"room:{room_id}",
    )
    assert (2, 1) in drains, drains
    # The answered sections were removed from the gateway's table.
    assert (
        _rows(
            url,
            "SELECT id FROM model.batch_section WHERE agent_id = %s AND id LIKE %s",
            agent_id,
            f"ev-{alice_id.hex}%",
        )
        == []
    )

    # REFLECTION: the fact, the relationship between the two entities (tags lower-cased, sorted), the
    # one with someone who is not an entity kept as a fact, and the reflection memory.
    def memories(kind: str) -> list[str]:
        rows = _rows(
            url,
            "SELECT content ->> 'text' FROM runtime.memory WHERE agent_id = %s AND kind = %s"
            " ORDER BY created_at",
            agent_id,
            kind,
        )
        return [r[0] for r in rows]

    await _until(lambda: "Alice talked about her brother Bob." in memories("reflections"), "the reflection")
    assert "Bob lives in Oslo" in memories("facts")
    assert "Alice is friend of Zed" in memories("facts")
    entity = {name: str(ids.entity_id(uuid.UUID(agent_id), "e2e", name.lower())) for name in ("Alice", "Bob")}
    relationships = _rows(
        url,
        "SELECT source_entity_id::text, target_entity_id::text, tags, metadata FROM runtime.relationship"
        " WHERE agent_id = %s",
        agent_id,
    )
    assert relationships == [
        (entity["Alice"], entity["Bob"], ["family", "sibling"], {"source": "reflection"})
    ]

    # The trajectory says which evaluator ran in which section and that no fallback was needed.
    [(trajectory,)] = _rows(
        url, "SELECT trajectory FROM runtime.turn WHERE agent_id = %s AND id = %s", agent_id, alice_id
    )
    evaluators = trajectory["evaluators"]
    assert evaluators["REFLECTION"]["values"] == {
        "facts": 1,
        "relationships": 1,
        "relationships_as_facts": 1,
        "reflection": True,
        "fallback": False,
    }
    assert evaluators["REFLECTION"]["batch"]["fallback_used"] is False
    assert evaluators["TOPIC"]["values"] == {"topic": "family"}
    assert json.dumps(evaluators).count('"attempts": 1') == 2

    # Per-evaluator fallback: TOPIC's field never came (asked twice: the batcher's retry), so TOPIC
    # got its fallback; REFLECTION, in the same call, got its answer.
    fallback_id = ids.message_id(uuid.UUID(agent_id), "e2e", fallback.message_id)
    await _until(lambda: f"TOPIC {fallback_id} unknown True" in log.read_text(), "TOPIC's fallback")
    await _until(lambda: "Nothing worth keeping." in memories("reflections"), "the second reflection")

    def recorded() -> Any:
        [(found,)] = _rows(
            url, "SELECT trajectory FROM runtime.turn WHERE agent_id = %s AND id = %s", agent_id, fallback_id
        )
        return found.get("evaluators")

    evaluators = await _until(recorded, "the evaluators' trajectory")
    assert evaluators["TOPIC"]["batch"]["fallback_used"] is True
    assert evaluators["TOPIC"]["batch"]["attempts"] == 2
    assert evaluators["REFLECTION"]["batch"]["fallback_used"] is False
    assert evaluators["REFLECTION"]["batch"]["attempts"] == 1
    assert (2, 2) in _rows(
        url,
        "SELECT sections, calls FROM model.batch_drain WHERE affinity = %s ORDER BY seq",
        f"room:{room_id}",
    )
