"""A runtime killed with SIGKILL mid-turn: the message is answered exactly once after a restart."""

from __future__ import annotations

import re
import urllib.request

import psycopg

from parley.v1 import runtime_pb2
from parley_platform.consumer import DEAD_REASON
from parley_platform.testing import ServiceProcess, eventually
from support import Suite, inbound, inbound_settled, publish_inbound, replies_to, stream_messages, turn_of


async def test_runtime_killed_mid_turn_answers_exactly_once(isolated_suite: Suite) -> None:
    suite = await isolated_suite.start(runtimes=1, PARLEY_ACK_WAIT_SECONDS="2")
    bus = await suite.connect()
    try:
        message = inbound("please be slow")  # the scripted model takes 2.5 s for this one
        await publish_inbound(bus, message)

        async def running() -> bool:
            return turn_of(suite.env.database_url, message) == ("running", 1)

        await eventually(running, timeout=20, what="the turn to start")
        suite.runtime.kill()
        assert await replies_to(bus, message) == []

        await suite.add_runtime(PARLEY_ACK_WAIT_SECONDS="2")
        replies = await eventually(lambda: replies_to(bus, message), timeout=30, what="a reply after restart")
        assert [r.text for r in replies] == ["Sorry for the wait."]

        await eventually(lambda: inbound_settled(bus), timeout=20, what="the redelivery acked")
        assert len(await replies_to(bus, message)) == 1
        turn = turn_of(suite.env.database_url, message)
        assert turn is not None
        assert turn[0] == "replied"
        assert turn[1] >= 2  # redelivered after the kill (more if a loaded machine let ack_wait pass)
    finally:
        await bus.close()


async def test_a_message_whose_every_delivery_dies_is_failed_and_dead_lettered(isolated_suite: Suite) -> None:
    """max_deliver 2, and the replica holding each delivery is killed: a third replica gets
    JetStream's max-deliveries advisory, dead-letters the message and fails its turn."""
    settings = {"PARLEY_ACK_WAIT_SECONDS": "2", "PARLEY_MAX_DELIVER": "2"}
    suite = await isolated_suite.start(runtimes=1, **settings)
    bus = await suite.connect()
    try:
        message = inbound("please be very slow")  # the scripted model takes 8 s
        await publish_inbound(bus, message)
        for attempt in (1, 2):

            async def running(attempt: int = attempt) -> bool:
                return turn_of(suite.env.database_url, message) == ("running", attempt)

            await eventually(running, timeout=30, what=f"delivery {attempt} to start")
            holder = suite.runtimes[-1]
            await suite.add_runtime(**settings)  # the next replica, ready before the holder dies
            holder.kill()

        async def failed() -> bool:
            return turn_of(suite.env.database_url, message) == ("failed", 2)

        await eventually(failed, timeout=30, what="the exhausted turn to be failed")
        with psycopg.connect(suite.env.database_url) as conn:
            row = conn.execute(
                "SELECT t.error FROM runtime.turn t JOIN runtime.memory m ON m.agent_id = t.agent_id"
                " AND m.id = t.id WHERE m.source = %s AND m.external_id = %s",
                (message.source, message.message_id),
            ).fetchone()
        assert row is not None
        assert "every delivery died unacknowledged" in row[0]
        dead = await stream_messages(bus, bus.subjects.dead(bus.subjects.stream("INBOUND")))
        assert len(dead) == 1
        assert runtime_pb2.InboundMessage.FromString(dead[0].data).message_id == message.message_id
        assert "no delivery was acknowledged" in (dead[0].headers or {})[DEAD_REASON]
        assert await replies_to(bus, message) == []
    finally:
        await bus.close()


async def test_two_replicas_share_the_load_and_answer_each_message_once(isolated_suite: Suite) -> None:
    suite = await isolated_suite.start(runtimes=2)
    bus = await suite.connect()
    try:
        messages = [inbound(f"message {i}", channel=f"room-{i % 10}") for i in range(60)]
        for message in messages:
            await publish_inbound(bus, message)
        await eventually(lambda: inbound_settled(bus), timeout=60, what="all messages handled")
        outcomes = {turn_of(suite.env.database_url, m)[0] for m in messages}  # type: ignore[index]
        assert outcomes <= {"replied", "superseded"}
        for message in messages:
            replies = await replies_to(bus, message)
            state = turn_of(suite.env.database_url, message)
            assert state is not None
            assert len(replies) == (1 if state[0] == "replied" else 0)
        handled = [turns_handled(process) for process in suite.runtimes]
        assert sum(handled) >= len(messages)
        assert all(count > 0 for count in handled), handled
    finally:
        await bus.close()


def turns_handled(process: ServiceProcess) -> float:
    port = process.env["PARLEY_RUNTIME_METRICS_PORT"]
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    return sum(
        float(v) for v in re.findall(r'^parley_turns_total\{outcome="[a-z]+"\} ([0-9.e+]+)$', text, re.M)
    )


async def test_a_recreated_inbound_stream_is_consumed_again_and_rooms_keep_answering(
    isolated_suite: Suite,
) -> None:
    """Deleting PARLEY_INBOUND and creating it again restarts its sequence numbers: the runtime's
    consumer is created again, and a room whose last message had a higher sequence still answers
    the new stream's first message (the turn lease orders by (stream epoch, sequence))."""
    suite = await isolated_suite.start(runtimes=1)
    bus = await suite.connect()
    try:
        channel = "recreated-stream"
        for n in range(3):
            before = inbound(f"message {n} before", channel=channel)
            await publish_inbound(bus, before)
            await eventually(lambda m=before: replies_to(bus, m), timeout=30, what=f"a reply to message {n}")
        await bus.js.delete_stream(bus.subjects.stream("INBOUND"))
        await bus.ensure_standard_streams()
        after = inbound("message after", channel=channel)
        await publish_inbound(bus, after)
        replies = await eventually(
            lambda: replies_to(bus, after), timeout=45, what="a reply from the new stream"
        )
        assert [r.text for r in replies] == ["You said: message after"]
        assert turn_of(suite.env.database_url, after) == ("replied", 1)
    finally:
        await bus.close()
