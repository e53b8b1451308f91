"""Agent turns through real NATS, PostgreSQL and the service processes."""

from __future__ import annotations

import secrets
import uuid

from parley.v1 import runtime_pb2
from parley_platform.bus import Bus
from parley_platform.consumer import DEAD_REASON, DEAD_SUBJECT
from parley_platform.testing import eventually
from support import (
    DEFAULT_AGENT_ID,
    Suite,
    inbound,
    inbound_settled,
    publish_inbound,
    replies_to,
    stream_messages,
    turn_of,
)


async def test_message_gets_one_reply(suite: Suite, bus: Bus) -> None:
    message = inbound("hello there")
    await publish_inbound(bus, message)

    replies = await eventually(lambda: replies_to(bus, message), timeout=20, what="a reply")

    assert [r.text for r in replies] == ["You said: hello there"]
    reply = replies[0]
    assert reply.actions == ["REPLY"]
    assert reply.agent_id == DEFAULT_AGENT_ID
    assert reply.channel_id == message.channel_id
    assert turn_of(suite.env.database_url, message) == ("replied", 1)


async def test_reply_id_is_derived_from_the_inbound_id(suite: Suite, bus: Bus) -> None:
    message = inbound("same ids everywhere")
    await publish_inbound(bus, message)
    [reply] = await eventually(lambda: replies_to(bus, message), timeout=20, what="a reply")
    inbound_id = uuid.uuid5(uuid.UUID(DEFAULT_AGENT_ID), f"e2e:message:{message.message_id}")
    assert reply.response_id == str(uuid.uuid5(inbound_id, "response:0"))
    [stored] = [
        m
        for m in await stream_messages(bus, bus.subjects.outbound(DEFAULT_AGENT_ID, "e2e"))
        if runtime_pb2.OutboundMessage.FromString(m.data).in_reply_to == message.message_id
    ]
    assert stored.headers is not None
    assert stored.headers["Nats-Msg-Id"] == reply.response_id


async def test_same_message_published_twice_is_answered_once(suite: Suite, bus: Bus) -> None:
    message = inbound("only once please")
    # Same Nats-Msg-Id: JetStream drops the copy. Different ids: both reach the runtime,
    # and its inbox in Postgres must recognise the second as the same message.
    await publish_inbound(bus, message)
    await publish_inbound(bus, message)
    await publish_inbound(bus, message, msg_id=f"republished-{secrets.token_hex(4)}")
    await publish_inbound(bus, message, msg_id=f"republished-{secrets.token_hex(4)}")

    await eventually(lambda: replies_to(bus, message), timeout=20, what="a reply")
    await eventually(lambda: inbound_settled(bus), timeout=20, what="every copy handled")
    assert len(await replies_to(bus, message)) == 1
    turn = turn_of(suite.env.database_url, message)
    assert turn is not None
    assert turn[0] == "replied"


async def test_model_says_ignore_sends_nothing(suite: Suite, bus: Bus) -> None:
    message = inbound("please ignore this")
    await publish_inbound(bus, message)

    async def finished() -> tuple[str, int] | None:
        turn = turn_of(suite.env.database_url, message)
        return turn if turn and turn[0] != "running" else None

    assert await eventually(finished, timeout=20, what="the turn to finish") == ("ignored", 1)
    await eventually(lambda: inbound_settled(bus), timeout=20, what="the message acked")
    assert await replies_to(bus, message) == []


async def test_bad_input_goes_to_the_dead_letter_stream_and_the_consumer_keeps_going(
    suite: Suite, bus: Bus
) -> None:
    marker = secrets.token_hex(4)
    unknown_agent = str(uuid.uuid4())
    bad: list[tuple[str, bytes, str]] = [
        (
            DEFAULT_AGENT_ID,
            b"\xff\x00 not a protobuf " + marker.encode(),
            "not a valid parley.v1.InboundMessage",
        ),
        (unknown_agent, inbound("hi", agent_id=unknown_agent).SerializeToString(), "unknown agent"),
        (DEFAULT_AGENT_ID, inbound("hi", source="").SerializeToString(), "source is required"),
        (DEFAULT_AGENT_ID, inbound("hi", source="has.dots").SerializeToString(), "source must be"),
        (DEFAULT_AGENT_ID, inbound("x" * (64 * 1024 + 1)).SerializeToString(), "over the limit of 65536"),
        (DEFAULT_AGENT_ID, inbound("hi", agent_id=unknown_agent).SerializeToString(), "does not match"),
    ]
    for index, (agent, payload, _) in enumerate(bad):
        await bus.publish(bus.subjects.inbound(agent, "e2e"), payload, msg_id=f"bad-{marker}-{index}")
    good = inbound("still alive?")
    await publish_inbound(bus, good)

    replies = await eventually(lambda: replies_to(bus, good), timeout=20, what="a reply after the bad input")
    assert replies[0].text == "You said: still alive?"

    async def dead_letters() -> list[str]:
        msgs = await stream_messages(bus, bus.subjects.dead(bus.subjects.stream("INBOUND")))
        mine = [m for m in msgs if (m.headers or {}).get("Nats-Msg-Id", "").startswith(f"bad-{marker}")]
        return [m.headers[DEAD_REASON] for m in mine if m.headers] if len(mine) == len(bad) else []

    reasons = await eventually(dead_letters, timeout=20, what="every bad message dead-lettered")
    for (_, _, expected), reason in zip(bad, sorted(reasons, key=lambda r: _order(r, bad)), strict=True):
        assert expected in reason
    msgs = await stream_messages(bus, bus.subjects.dead(bus.subjects.stream("INBOUND")))
    subjects = {(m.headers or {}).get(DEAD_SUBJECT) for m in msgs}
    assert bus.subjects.inbound(unknown_agent, "e2e") in subjects
    await eventually(lambda: inbound_settled(bus), timeout=20, what="nothing left to redeliver")


def _order(reason: str, bad: list[tuple[str, bytes, str]]) -> int:
    return next(i for i, (_, _, expected) in enumerate(bad) if expected in reason)
