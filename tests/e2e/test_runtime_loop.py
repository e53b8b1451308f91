"""The runtime's turn loop, case by case, through real NATS, PostgreSQL and service processes.

The scripted model's rules for these cases are in tests/e2e/rules.yaml; the test agent
`tester` (tests/characters/tester.yaml) adds the actions of tests/plugins/fixtures.py.
"""

from __future__ import annotations

import json
import secrets
import shutil
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import psycopg
import pytest

from parley.v1 import runtime_pb2, runtime_pb2_grpc
from parley_platform.bus import Bus
from parley_platform.testing import eventually
from support import (
    AGENT_NAMESPACE,
    DEFAULT_AGENT_ID,
    ROOT,
    SessionEnv,
    Suite,
    inbound,
    publish_inbound,
    replies_to,
    scraped,
)

TESTER_ID = str(uuid.uuid5(AGENT_NAMESPACE, "agent:tester"))
TERMINAL = ("replied", "ignored", "failed", "superseded")
TEXT_MODELS = ("TEXT_LARGE", "TEXT_SMALL")


class Loop:
    """A suite serving `default` and `tester`, with trajectory logging and a log of fixture actions."""

    def __init__(self, suite: Suite, bus: Bus, fixture_log: Path, runtime_env: dict[str, str]) -> None:
        self.suite = suite
        self.bus = bus
        self.fixture_log = fixture_log
        self.runtime_env = runtime_env

    def fixture_lines(self) -> list[str]:
        return self.fixture_log.read_text().splitlines() if self.fixture_log.exists() else []

    async def send(
        self,
        text: str,
        *,
        agent: str = DEFAULT_AGENT_ID,
        channel: str | None = None,
        room_type: int = runtime_pb2.ROOM_TYPE_DM,
        sender: str = "alice",
        mentions: bool = False,
        metadata: dict[str, str] | None = None,
    ) -> runtime_pb2.InboundMessage:
        message = inbound(
            text,
            agent_id=agent,
            channel=channel or f"c-{secrets.token_hex(4)}",
            room_type=room_type,
            sender=sender,
        )
        message.mentions_agent = mentions
        message.metadata.update(metadata or {})
        await publish_inbound(self.bus, message)
        return message

    def turn(self, message: runtime_pb2.InboundMessage) -> dict[str, Any] | None:
        with psycopg.connect(self.suite.env.database_url) as conn:
            row = conn.execute(
                "SELECT t.id, t.state, t.reason, t.attempts, t.trajectory FROM runtime.turn t"
                " JOIN runtime.memory m ON m.agent_id = t.agent_id AND m.id = t.id"
                " WHERE m.agent_id = %s AND m.source = %s AND m.external_id = %s",
                (message.agent_id, message.source, message.message_id),
            ).fetchone()
        if row is None:
            return None
        return {"id": row[0], "state": row[1], "reason": row[2], "attempts": row[3], "trajectory": row[4]}

    async def finished(self, message: runtime_pb2.InboundMessage, timeout: float = 20) -> dict[str, Any]:
        async def done() -> dict[str, Any] | None:
            turn = self.turn(message)
            return turn if turn and turn["state"] in TERMINAL else None

        return await eventually(done, timeout=timeout, what=f"the turn of {message.text!r} to finish")

    async def reply(self, message: runtime_pb2.InboundMessage) -> runtime_pb2.OutboundMessage:
        [reply] = await eventually(lambda: replies_to(self.bus, message), timeout=20, what="a reply")
        return reply

    def model_calls(self) -> float:
        """The text-model calls the gateway has answered so far."""
        assert self.suite.gateway is not None
        port = self.suite.gateway.env["PARLEY_GATEWAY_METRICS_PORT"]
        return sum(scraped(port, "parley_model_requests_total", f'model_type="{t}"') for t in TEXT_MODELS)

    async def idle(self) -> None:
        """Wait until no finished turn's after-reply work (its evaluators' model calls) is running:
        an earlier turn's REFLECTION may otherwise be counted in the middle of a test."""

        async def quiet() -> bool:
            ports = [r.env["PARLEY_RUNTIME_METRICS_PORT"] for r in self.suite.runtimes]
            return all(scraped(port, "parley_turn_background_tasks") == 0 for port in ports)

        await eventually(quiet, timeout=30, what="the runtime's after-reply work to finish")


@pytest.fixture(scope="module")
async def loop(test_env: SessionEnv, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Loop]:
    root = tmp_path_factory.mktemp("loop")
    characters = root / "characters"
    characters.mkdir()
    shutil.copy(ROOT / "characters" / "default.yaml", characters)
    shutil.copy(ROOT / "tests" / "characters" / "tester.yaml", characters)
    suite = Suite(test_env, root / "logs", f"l{secrets.token_hex(4)}")
    fixture_log = root / "fixtures.log"
    runtime_env = {
        "PARLEY_CHARACTERS_DIR": str(characters),
        "PARLEY_TRAJECTORY_LOGGING": "true",
        "PYTHONPATH": str(ROOT / "tests"),
        "FIXTURE_LOG": str(fixture_log),
        "PARLEY_ACK_WAIT_SECONDS": "2",
        "FIXTURE_EFFECT_SECONDS": "3",
    }
    await suite.start(runtimes=1, **runtime_env)
    bus = await suite.connect()
    try:
        yield Loop(suite, bus, fixture_log, runtime_env)
    finally:
        await bus.close()
        suite.stop()


# Whether a turn asked the model if it should respond is read from its trajectory, where the
# should-respond stage records the question's answer, not from the gateway's count of small-model
# calls: an earlier turn's REFLECTION (a small-model call in the background after its reply) may
# be counted at any moment.


def asked_whether_to_respond(turn: dict[str, Any]) -> bool:
    return "should_respond" in (turn["trajectory"] or {})


async def test_dm_is_answered_without_asking_whether_to_respond(loop: Loop) -> None:
    message = await loop.send("hello in a DM")
    assert (await loop.reply(message)).text == "You said: hello in a DM"
    turn = await loop.finished(message)
    assert turn["state"] == "replied"
    assert not asked_whether_to_respond(turn)
    assert len(await replies_to(loop.bus, message)) == 1


async def test_group_message_the_model_declines_is_ignored_and_remembered(loop: Loop) -> None:
    message = await loop.send("please stay out of this", room_type=runtime_pb2.ROOM_TYPE_GROUP)
    turn = await loop.finished(message)
    assert (turn["state"], turn["reason"]) == ("ignored", "model:ignore")
    assert turn["trajectory"]["should_respond"]["model"] == "small"
    assert await replies_to(loop.bus, message) == []
    with psycopg.connect(loop.suite.env.database_url) as conn:
        [(content,)] = conn.execute(
            "SELECT content FROM runtime.memory WHERE agent_id = %s AND in_reply_to = %s",
            (DEFAULT_AGENT_ID, turn["id"]),
        ).fetchall()
    assert content["actions"] == ["IGNORE"]
    assert content["simple"] is True


async def test_group_message_the_model_takes_up_and_a_mention_needs_no_question(loop: Loop) -> None:
    joined = await loop.send("please join in", room_type=runtime_pb2.ROOM_TYPE_GROUP)
    assert (await loop.reply(joined)).text == "You said: please join in"
    joined_turn = await loop.finished(joined)
    assert joined_turn["state"] == "replied"
    assert joined_turn["trajectory"]["should_respond"]["model"] == "small"
    mentioned = await loop.send("hey you", room_type=runtime_pb2.ROOM_TYPE_GROUP, mentions=True)
    assert (await loop.reply(mentioned)).text == "You said: hey you"
    mentioned_turn = await loop.finished(mentioned)
    assert mentioned_turn["state"] == "replied"
    assert not asked_whether_to_respond(mentioned_turn)


async def test_message_from_the_agent_itself_costs_no_model_call(loop: Loop) -> None:
    await loop.idle()
    calls = loop.model_calls()
    message = await loop.send("an echo of my own words", sender=DEFAULT_AGENT_ID)
    turn = await loop.finished(message)
    assert (turn["state"], turn["reason"]) == ("ignored", "self")
    await loop.idle()
    assert loop.model_calls() == calls


async def test_muted_agent_stays_silent_even_when_mentioned_until_unmuted(loop: Loop) -> None:
    channel = f"group-{secrets.token_hex(3)}"
    group = runtime_pb2.ROOM_TYPE_GROUP
    mute = await loop.send("please mute", channel=channel, room_type=group, mentions=True)
    assert (await loop.finished(mute))["state"] == "ignored"  # MUTE_ROOM says nothing
    await loop.idle()
    calls = loop.model_calls()
    mentioned = await loop.send("are you there?", channel=channel, room_type=group, mentions=True)
    turn = await loop.finished(mentioned)
    assert (turn["state"], turn["reason"]) == ("ignored", "muted")
    await loop.idle()
    assert loop.model_calls() == calls
    assert await replies_to(loop.bus, mentioned) == []


async def test_an_expired_timed_mute_is_lifted(loop: Loop) -> None:
    channel = f"group-{secrets.token_hex(3)}"
    group = runtime_pb2.ROOM_TYPE_GROUP
    mute = await loop.send("please mute briefly", channel=channel, room_type=group, mentions=True)
    await loop.finished(mute)
    room_id = uuid.uuid5(uuid.UUID(DEFAULT_AGENT_ID), f"e2e:room:{channel}")

    def mute_until() -> Any:
        with psycopg.connect(loop.suite.env.database_url) as conn:
            row = conn.execute(
                "SELECT user_state, mute_until, mute_until <= now() FROM runtime.participant"
                " WHERE agent_id = %s AND room_id = %s AND entity_id = %s",
                (DEFAULT_AGENT_ID, room_id, DEFAULT_AGENT_ID),
            ).fetchone()
        return row

    state = mute_until()
    assert state is not None
    assert state[0] == "MUTED"
    assert state[1] is not None

    async def expired() -> bool:
        row = mute_until()
        return bool(row and row[2])

    await eventually(expired, timeout=10, what="the timed mute to expire")
    after = await loop.send("back yet?", channel=channel, room_type=group, mentions=True)
    assert (await loop.reply(after)).text == "You said: back yet?"
    assert mute_until()[0] is None


async def test_ignore_beside_reply_with_text_keeps_only_the_reply(loop: Loop) -> None:
    message = await loop.send("say both")
    reply = await loop.reply(message)
    assert reply.actions == ["REPLY"]
    assert reply.text == "Both were asked; only the reply remains."


async def test_text_with_only_unknown_actions_is_still_the_answer(loop: Loop) -> None:
    message = await loop.send("use a made-up action")
    reply = await loop.reply(message)
    assert reply.text == "I cannot fly there, but here is my answer."
    assert reply.actions == ["REPLY"]
    turn = await loop.finished(message)
    recorded = [(a["name"], a["outcome"]) for a in (turn["trajectory"] or {}).get("actions", [])]
    assert recorded == [("FLY_TO_MARS", "unknown"), ("REPLY", "success")]


async def test_newer_message_supersedes_a_slow_older_one(loop: Loop) -> None:
    channel = f"race-{secrets.token_hex(3)}"
    slow = await loop.send("please be slow", channel=channel)
    await eventually(lambda: _running(loop, slow), timeout=10, what="the slow turn to start")
    fast = await loop.send("quick one", channel=channel)
    assert (await loop.reply(fast)).text == "You said: quick one"
    assert (await loop.finished(slow))["state"] == "superseded"
    assert await replies_to(loop.bus, slow) == []


async def _running(loop: Loop, message: runtime_pb2.InboundMessage) -> bool:
    turn = loop.turn(message)
    return bool(turn and turn["state"] == "running")


async def test_private_action_on_a_user_turn_is_rejected_and_never_runs(loop: Loop) -> None:
    message = await loop.send("run the private op", agent=TESTER_ID)
    assert (await loop.reply(message)).text == "Tried."
    turn = await loop.finished(message)
    [private] = [a for a in turn["trajectory"]["actions"] if a["name"] == "PRIVATE_OP"]
    assert private["outcome"] == "rejected"
    assert "private" in private["result"]["error"]
    assert not any(line.startswith("PRIVATE_OP") for line in loop.fixture_lines())


async def test_private_action_claimed_autonomous_by_a_connector_is_still_rejected(loop: Loop) -> None:
    """Metadata on a connector's subject cannot make a turn autonomous (issue 12)."""
    message = await loop.send(
        "run the private op",
        agent=TESTER_ID,
        metadata={"is_autonomous": "true", "parley_origin": "autonomous"},
    )
    assert (await loop.reply(message)).text == "Tried."
    turn = await loop.finished(message)
    [private] = [a for a in turn["trajectory"]["actions"] if a["name"] == "PRIVATE_OP"]
    assert private["outcome"] == "rejected"
    assert "private" in private["result"]["error"]
    assert not any(line.startswith("PRIVATE_OP") for line in loop.fixture_lines())


async def test_role_gates_follow_the_participant_role(loop: Loop) -> None:
    member = await loop.send("run the admin op", agent=TESTER_ID)
    turn = await loop.finished(member)
    [admin] = [a for a in turn["trajectory"]["actions"] if a["name"] == "ADMIN_OP"]
    assert admin["outcome"] == "rejected"
    boss = await loop.send("run the admin op", agent=TESTER_ID, metadata={"sender_role": "ADMIN"})
    turn = await loop.finished(boss)
    [admin] = [a for a in turn["trajectory"]["actions"] if a["name"] == "ADMIN_OP"]
    assert admin["outcome"] == "success"
    assert f"ADMIN_OP {turn['id']} ADMIN" in loop.fixture_lines()


async def test_a_handler_exception_is_a_failed_result_not_a_failed_turn(loop: Loop) -> None:
    message = await loop.send("run the flaky op", agent=TESTER_ID)
    assert (await loop.reply(message)).text == "Still here."
    turn = await loop.finished(message)
    assert turn["state"] == "replied"
    [flaky] = [a for a in turn["trajectory"]["actions"] if a["name"] == "FLAKY_OP"]
    assert (flaky["outcome"], flaky["result"]["error"]) == ("error", "RuntimeError: the flaky op failed")


async def test_missing_required_params_get_one_repair_call(loop: Loop) -> None:
    message = await loop.send("what is the forecast for tomorrow", agent=TESTER_ID)
    assert (await loop.reply(message)).text == "Sunny in Oslo."
    turn = await loop.finished(message)
    [forecast] = [a for a in turn["trajectory"]["actions"] if a["name"] == "FORECAST"]
    assert forecast["params"] == {"city": "Oslo"}
    assert forecast["extraction_calls"] == 1


async def test_listed_providers_are_consulted_and_the_model_asked_again(loop: Loop) -> None:
    message = await loop.send("please use the word", agent=TESTER_ID)
    assert (await loop.reply(message)).text == "kiwi!"
    turn = await loop.finished(message)
    assert turn["trajectory"]["re_ask"]["providers"] == ["SECRET_WORD"]
    assert "the secret word is kiwi" in turn["trajectory"]["providers"]["SECRET_WORD"]


async def test_secrets_never_leave_in_replies_events_or_trajectories(loop: Loop) -> None:
    events: list[runtime_pb2.Event] = []

    async def on_event(msg: Any) -> None:
        events.append(runtime_pb2.Event.FromString(msg.data))

    sub = await loop.bus.subscribe(loop.bus.subjects.events(TESTER_ID, "*"), on_event)
    try:
        message = await loop.send("my key is sk-test-very-secret-123, keep it", agent=TESTER_ID)
        reply = await loop.reply(message)
        turn = await loop.finished(message)
        await eventually(lambda: _has(events, "RUN_ENDED"), timeout=10, what="the RUN_ENDED event")
    finally:
        await sub.unsubscribe()
    assert reply.text == "You said: my key is [REDACTED], keep it"
    assert "sk-test-very-secret-123" not in json.dumps(turn["trajectory"])
    assert [e.type for e in events if e.turn_id == str(turn["id"])] == [
        "RUN_STARTED",
        "ACTION_STARTED",
        "ACTION_COMPLETED",
        "MESSAGE_SENT",
        "RUN_ENDED",
    ]
    assert events[-1].attributes["status"] == "replied"


async def _has(events: list[runtime_pb2.Event], event_type: str) -> bool:
    return any(e.type == event_type for e in events)


async def test_trajectory_is_readable_through_the_operator_api(loop: Loop) -> None:
    message = await loop.send("show me your work")
    await loop.reply(message)
    turn = await loop.finished(message)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{loop.suite.runtime.grpc_port}") as channel:
        stub = runtime_pb2_grpc.RuntimeStub(channel)
        auth = [("authorization", f"Bearer {loop.suite.env.token}")]
        got = await stub.GetTurn(
            runtime_pb2.GetTurnRequest(agent_id="default", turn_id=str(turn["id"])), metadata=auth, timeout=10
        )
        listed = await stub.ListTurns(
            runtime_pb2.ListTurnsRequest(agent_id="default"), metadata=auth, timeout=10
        )
    trajectory = json.loads(got.trajectory_json)
    assert got.state == "replied"
    assert trajectory["segments"][0]["stable"] is True
    assert "# Current message" in trajectory["segments"][-1]["content"]
    assert trajectory["raw_output"].startswith("<response>")
    assert [a["name"] for a in trajectory["actions"]] == ["REPLY"]
    assert "CHARACTER" in trajectory["providers"]
    assert str(turn["id"]) in [t.id for t in listed.turns]


async def test_reflection_on_every_fourth_turn_stores_facts_that_later_turns_find(loop: Loop) -> None:
    """REFLECTION's default cadence (elizaOS's): the room's fourth turn reflects over the messages
    since the room began, so the fact told in its first turn is stored, and no turn before it
    reflected."""
    channel = f"c-{secrets.token_hex(4)}"
    said = []
    for text in ("my favourite colour is teal", "the weather is nice today", "I will walk later", "ok"):
        message = await loop.send(text, channel=channel)
        await loop.reply(message)  # one after the other: the room's turns 1 to 4
        said.append(message)

    async def fact_stored() -> bool:
        with psycopg.connect(loop.suite.env.database_url) as conn:
            row = conn.execute(
                "SELECT count(*) FROM runtime.memory WHERE agent_id = %s AND kind = 'facts'"
                " AND content ->> 'text' = 'Alice likes the colour teal' AND embedding IS NOT NULL",
                (DEFAULT_AGENT_ID,),
            ).fetchone()
        return bool(row and row[0] == 1)

    await eventually(fact_stored, timeout=20, what="the reflected fact")
    await loop.idle()
    reflected = [
        "REFLECTION" in ((await loop.finished(m))["trajectory"] or {}).get("evaluators", {}) for m in said
    ]
    assert reflected == [False, False, False, True]
    asked = await loop.send("what colour do I like?")
    assert (await loop.reply(asked)).text == "You like teal."
    async with grpc.aio.insecure_channel(f"127.0.0.1:{loop.suite.runtime.grpc_port}") as channel:
        found = await runtime_pb2_grpc.RuntimeStub(channel).SearchMemories(
            runtime_pb2.SearchMemoriesRequest(agent_id="default", query="which colour does alice like"),
            metadata=[("authorization", f"Bearer {loop.suite.env.token}")],
            timeout=10,
        )
    assert found.hits[0].memory.text == "Alice likes the colour teal"


async def test_agents_added_and_disabled_live(loop: Loop) -> None:
    auth = [("authorization", f"Bearer {loop.suite.env.token}")]
    name = f"live{secrets.token_hex(3)}"
    async with grpc.aio.insecure_channel(f"127.0.0.1:{loop.suite.runtime.grpc_port}") as channel:
        stub = runtime_pb2_grpc.RuntimeStub(channel)
        agent = await stub.UpsertAgent(
            runtime_pb2.UpsertAgentRequest(character=f"name: {name}\nbio: [new]\n"), metadata=auth, timeout=10
        )
        first = await loop.send("hello newcomer", agent=agent.id)
        assert (await loop.reply(first)).text == "You said: hello newcomer"
        await stub.SetAgentEnabled(
            runtime_pb2.SetAgentEnabledRequest(agent_id=name, enabled=False), metadata=auth, timeout=10
        )
        second = await loop.send("are you off?", agent=agent.id)
        turn = await loop.finished(second)
        assert (turn["state"], turn["reason"]) == ("ignored", "disabled")
        with pytest.raises(grpc.aio.AioRpcError) as failure:
            await stub.UpsertAgent(
                runtime_pb2.UpsertAgentRequest(character="name: ok\nplugins: [nothing_here]\n"),
                metadata=auth,
                timeout=10,
            )
        assert failure.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "unknown plugin 'nothing_here'" in (failure.value.details() or "")


async def test_a_claimed_effect_is_never_run_twice_after_a_crash(loop: Loop) -> None:
    """A runtime killed while a non-idempotent handler runs: the redelivered turn finds the claim
    without a result, reports UNCERTAIN_EFFECT and does not run the handler again."""
    message = await loop.send("run the slow effect", agent=TESTER_ID)
    turn_id = uuid.uuid5(uuid.UUID(TESTER_ID), f"e2e:message:{message.message_id}")

    async def started() -> bool:
        return f"SLOW_EFFECT start {turn_id}" in loop.fixture_lines()

    await eventually(started, timeout=20, what="the effect to start")
    loop.suite.runtime.kill()
    loop.suite.runtimes.pop(0)
    await loop.suite.add_runtime(**loop.runtime_env)
    reply = await loop.reply(message)
    assert reply.text == "Effect done."
    turn = await loop.finished(message)
    [effect] = [a for a in turn["trajectory"]["actions"] if a["name"] == "SLOW_EFFECT"]
    assert effect["outcome"] == "uncertain"
    assert effect["result"]["error"].startswith("UNCERTAIN_EFFECT")
    assert sum(line.startswith(f"SLOW_EFFECT start {turn_id}") for line in loop.fixture_lines()) == 1
