"""Dead letters operable: a message dead-lettered for a real reason (its agent did not exist),
fixed (the agent created), replayed → answered once; replaying twice answers once; a dead letter
of a message that was in fact answered is replayed without a second answer; list/show/purge with
filters, through the CLI and gRPC; only the operator may use them."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import grpc
import pytest

from parley.v1 import dead_pb2, dead_pb2_grpc, runtime_pb2, runtime_pb2_grpc
from parley_platform.bus import Bus
from parley_platform.consumer import DEAD_CONSUMER, DEAD_MSG_ID, DEAD_REASON, DEAD_STREAM, DEAD_SUBJECT
from parley_platform.testing import eventually
from support import Suite, inbound, publish_inbound, replies_to, stream_messages

PARLEY = str(Path(sys.executable).parent / "parley")
AGENT_NAMESPACE = uuid.UUID("6f1f3f3e-6a0c-5b8e-9a57-5061726c6579")


class Dead:
    def __init__(self, suite: Suite, bus: Bus, channel: grpc.aio.Channel) -> None:
        self.suite = suite
        self.bus = bus
        self.stub = dead_pb2_grpc.DeadLettersStub(channel)
        self.runtime = runtime_pb2_grpc.RuntimeStub(channel)
        self.auth = [("authorization", f"Bearer {suite.env.token}")]

    async def call(self, method: str, request: object, timeout: float = 60) -> object:
        return await getattr(self.stub, method)(request, metadata=self.auth, timeout=timeout)

    async def listed(self, **filters: object) -> list[dead_pb2.DeadLetter]:
        reply = await self.call(
            "ListDeadLetters", dead_pb2.ListDeadLettersRequest(filter=dead_pb2.DeadLetterFilter(**filters))
        )
        assert isinstance(reply, dead_pb2.ListDeadLettersResponse)
        return list(reply.dead_letters)

    async def replay(self, *sequences: int, wait: float = 30) -> list[dead_pb2.Replayed]:
        reply = await self.call(
            "ReplayDeadLetters",
            dead_pb2.ReplayDeadLettersRequest(
                filter=dead_pb2.DeadLetterFilter(sequences=sequences), wait_seconds=wait
            ),
        )
        assert isinstance(reply, dead_pb2.ReplayDeadLettersResponse)
        return list(reply.replayed)

    def cli(self, *args: str) -> subprocess.CompletedProcess[str]:
        env = {
            "PATH": "/usr/bin:/bin",
            "PARLEY_OPERATOR_TOKEN": self.suite.env.token,
            "PARLEY_RUNTIME_ADDR": f"127.0.0.1:{self.suite.runtime.grpc_port}",
        }
        return subprocess.run([PARLEY, "dead", *args], env=env, capture_output=True, text=True, timeout=120)

    async def create_agent(self, name: str) -> None:
        await self.runtime.UpsertAgent(
            runtime_pb2.UpsertAgentRequest(character=json.dumps({"name": name, "bio": "late"})),
            metadata=self.auth,
            timeout=10,
        )


@pytest.fixture
async def dead(isolated_suite: Suite) -> AsyncIterator[Dead]:
    suite = await isolated_suite.start(runtimes=1)
    bus = await suite.connect()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{suite.runtime.grpc_port}") as channel:
            yield Dead(suite, bus, channel)
    finally:
        await bus.close()


async def dead_letter_of(dead: Dead, message: runtime_pb2.InboundMessage) -> dead_pb2.DeadLetter:
    async def found() -> list[dead_pb2.DeadLetter]:
        return [d for d in await dead.listed(stream="INBOUND") if d.msg_id == f"e2e:{message.message_id}"]

    [letter] = await eventually(found, timeout=30, what="the dead letter")
    return letter


async def test_dead_lettered_for_an_unknown_agent_then_fixed_and_replayed_is_answered_once(
    dead: Dead,
) -> None:
    name = f"late{uuid.uuid4().hex[:6]}"
    agent_id = str(uuid.uuid5(AGENT_NAMESPACE, f"agent:{name}"))
    first, second = inbound("hello late agent", agent_id=agent_id), inbound("again", agent_id=agent_id)
    for message in (first, second):
        await publish_inbound(dead.bus, message)
    letter = await dead_letter_of(dead, first)
    other = await dead_letter_of(dead, second)
    assert "unknown agent" in letter.reason
    assert (letter.agent_id, letter.consumer, letter.deliveries) == (agent_id, "runtime", 1)

    # Filters: by agent (the name is not an agent yet: matched as given), reason, time.
    by_agent = {d.sequence for d in await dead.listed(agent=agent_id)}
    assert by_agent == {letter.sequence, other.sequence}
    assert {d.sequence for d in await dead.listed(reason="UNKNOWN AGENT", agent=agent_id)} == by_agent
    assert await dead.listed(reason="no such reason") == []
    future = dead_pb2.DeadLetterFilter()
    future.since.FromDatetime(datetime.now(UTC) + timedelta(hours=1))
    assert await dead.listed(since=future.since, agent=agent_id) == []
    assert await dead.listed(stream="EVENTS", agent=agent_id) == []

    # The CLI: list and show.
    listed = dead.cli("list", "--agent", agent_id)
    assert listed.returncode == 0, listed.stderr
    assert f"{letter.sequence}  " in listed.stdout
    assert "unknown agent" in listed.stdout
    shown = dead.cli("show", str(letter.sequence), "--json")
    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout)["msg_id"] == f"e2e:{first.message_id}"

    # Replayed before the fix: dead-lettered again (a new dead letter), the old one removed.
    [again] = await dead.replay(other.sequence)
    assert again.outcome == "handled"
    [redead] = [d for d in await dead.listed(agent=agent_id) if d.sequence not in by_agent]
    assert redead.msg_id == f"e2e:{second.message_id}:replay:{other.sequence}"

    await dead.create_agent(name)
    # Twice at once: one copy (the same dedup identity), one answer.
    results = await asyncio.gather(dead.replay(letter.sequence), dead.replay(letter.sequence))
    outcomes = sorted(r.outcome for [r] in results)
    assert outcomes == ["handled", "handled"], results
    assert len({r.replay_sequence for [r] in results}) == 1
    replies = await eventually(lambda: replies_to(dead.bus, first), timeout=30, what="the reply")
    assert [r.text for r in replies] == ["You said: hello late agent"]
    # And once more, through the CLI: the dead letter is gone.
    gone = dead.cli("replay", str(letter.sequence))
    assert gone.returncode == 1
    assert f"no dead letter {letter.sequence}" in gone.stderr
    replayed = dead.cli("replay", str(redead.sequence), "--wait", "30")
    assert replayed.returncode == 0, replayed.stdout + replayed.stderr
    assert "handled" in replayed.stdout
    await eventually(lambda: replies_to(dead.bus, second), timeout=30, what="the second reply")
    await asyncio.sleep(1)
    assert len(await replies_to(dead.bus, first)) == 1
    assert len(await replies_to(dead.bus, second)) == 1
    assert await dead.listed(agent=agent_id) == []


async def test_a_dead_letter_of_an_answered_message_is_replayed_without_a_second_answer(dead: Dead) -> None:
    """The original dedup identity: the runtime stored the message once, so a copy is a duplicate."""
    message = inbound("answered already")
    await publish_inbound(dead.bus, message)
    await eventually(lambda: replies_to(dead.bus, message), timeout=30, what="the reply")
    inbound_stream = dead.bus.subjects.stream("INBOUND")
    subject = dead.bus.subjects.inbound(message.agent_id, message.source)
    await dead.bus.publish(
        dead.bus.subjects.dead(inbound_stream),
        message.SerializeToString(),
        msg_id=f"dead-{message.message_id}",
        headers={
            DEAD_REASON: "max_deliver (5) reached: no delivery was acknowledged",
            DEAD_STREAM: inbound_stream,
            DEAD_SUBJECT: subject,
            DEAD_CONSUMER: "runtime",
            DEAD_MSG_ID: f"e2e:{message.message_id}",
        },
    )
    letter = await dead_letter_of(dead, message)
    [result] = await dead.replay(letter.sequence)
    assert result.outcome == "handled"
    await asyncio.sleep(1.5)
    assert len(await replies_to(dead.bus, message)) == 1


async def test_purge_needs_a_selection_and_only_the_operator_gets_in(dead: Dead) -> None:
    ghost = str(uuid.uuid4())
    messages = [inbound(f"to nobody {i}", agent_id=ghost) for i in range(3)]
    for message in messages:
        await publish_inbound(dead.bus, message)
    for message in messages:
        await dead_letter_of(dead, message)

    refused = dead.cli("purge")
    assert refused.returncode == 1
    assert "set all to purge every one" in refused.stderr
    bad_time = dead.cli("list", "--since", "yesterday")
    assert bad_time.returncode == 1
    assert "ISO 8601" in bad_time.stderr
    with pytest.raises(grpc.aio.AioRpcError) as missing:
        await dead.call("GetDeadLetter", dead_pb2.GetDeadLetterRequest(sequence=10**9))
    assert missing.value.code() == grpc.StatusCode.NOT_FOUND

    # Without the operator's token: refused, over gRPC.
    for method, request in (
        ("ListDeadLetters", dead_pb2.ListDeadLettersRequest()),
        ("PurgeDeadLetters", dead_pb2.PurgeDeadLettersRequest(all=True)),
    ):
        with pytest.raises(grpc.aio.AioRpcError) as denied:
            await getattr(dead.stub, method)(request, metadata=[("authorization", "Bearer nope")], timeout=10)
        assert denied.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert len(await dead.listed(agent=ghost)) == 3

    purged = dead.cli("purge", "--agent", ghost, "--reason", "unknown agent")
    assert purged.returncode == 0, purged.stderr
    assert purged.stdout.strip() == "purged: 3"
    assert await dead.listed(agent=ghost) == []
    remaining = await stream_messages(dead.bus, dead.bus.subjects.dead(dead.bus.subjects.stream("INBOUND")))
    assert all(ghost not in m.subject for m in remaining)
