"""The walking skeleton: one real turn through NATS, PostgreSQL and two service processes."""

from __future__ import annotations

import asyncio
import uuid

import psycopg
from nats.js.api import ConsumerConfig, DeliverPolicy

from parley.v1 import runtime_pb2
from parley_platform.bus import MSG_ID, Bus
from parley_platform.testing import eventually
from support import Suite

AGENT_ID = str(uuid.uuid5(uuid.UUID("6f1f3f3e-6a0c-5b8e-9a57-5061726c6579"), "agent:default"))


def inbound(
    text: str,
    *,
    message_id: str | None = None,
    channel: str = "e2e",
    source: str = "e2e",
    sender: str = "alice",
) -> runtime_pb2.InboundMessage:
    return runtime_pb2.InboundMessage(
        agent_id=AGENT_ID,
        source=source,
        message_id=message_id or uuid.uuid4().hex,
        sender_id=sender,
        sender_name=sender.title(),
        channel_id=channel,
        room_type=runtime_pb2.ROOM_TYPE_DM,
        text=text,
    )


async def replies_to(bus: Bus, message_id: str, source: str = "e2e") -> list[runtime_pb2.OutboundMessage]:
    """Every message on the outbound stream answering ``message_id`` (read from the stream, not a live sub)."""
    subject = bus.subjects.outbound(AGENT_ID, source)
    sub = await bus.js.subscribe(
        subject, ordered_consumer=True, config=ConsumerConfig(deliver_policy=DeliverPolicy.ALL)
    )
    found = []
    try:
        while True:
            try:
                msg = await sub.next_msg(timeout=0.3)
            except TimeoutError:
                break
            reply = runtime_pb2.OutboundMessage.FromString(msg.data)
            if reply.in_reply_to == message_id:
                found.append(reply)
    finally:
        await sub.unsubscribe()
    return found


async def test_message_gets_one_reply(suite: Suite, bus: Bus) -> None:
    message = inbound("hello there")
    await bus.publish(
        bus.subjects.inbound(AGENT_ID), message.SerializeToString(), msg_id=f"e2e:{message.message_id}"
    )

    async def answered() -> list[runtime_pb2.OutboundMessage]:
        return await replies_to(bus, message.message_id)

    replies = await eventually(answered, timeout=20, what="a reply")
    assert len(replies) == 1
    assert replies[0].text == "You said: hello there"
    assert replies[0].actions == ["REPLY"]
    with psycopg.connect(suite.env.database_url) as conn:
        rows = conn.execute(
            "SELECT state, attempts FROM runtime.turn WHERE id = %s",
            (uuid.UUID(replies[0].response_id) and None,),
        ).fetchall()
        assert rows == []
        turns = conn.execute(
            "SELECT t.state, t.response_id FROM runtime.turn t JOIN runtime.memory m"
            " ON m.agent_id = t.agent_id AND m.id = t.id WHERE m.external_id = %s",
            (message.message_id,),
        ).fetchall()
    assert turns == [("replied", uuid.UUID(replies[0].response_id))]
    await asyncio.sleep(0)
