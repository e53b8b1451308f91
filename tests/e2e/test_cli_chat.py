"""`parley chat` as a user runs it (a real process against the real suite): replies come through
the user's durable consumer, so one produced while no chat was open is shown when the user comes
back, once; stream chunks are printed as they arrive."""

from __future__ import annotations

import asyncio
import secrets
import subprocess

from nats.js.api import ConsumerConfig, DeliverPolicy
from test_cli import PARLEY, cli_env

from parley.v1 import runtime_pb2
from parley_cli.client import FORGET_AFTER, TERMINAL_SOURCE, terminal_durable
from parley_platform.testing import eventually
from support import DEFAULT_AGENT_ID, Suite


async def parley(suite: Suite, *args: str, stdin: str = "", timeout: float = 60) -> tuple[int, str, str]:
    process = await asyncio.create_subprocess_exec(
        PARLEY,
        *args,
        env=cli_env(suite),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(process.communicate(stdin.encode()), timeout)
    return process.returncode or 0, out.decode(), err.decode()


async def test_chat_answers_in_the_terminal(suite: Suite) -> None:
    user = f"chatter{secrets.token_hex(3)}"
    code, out, err = await parley(suite, "chat", "--user", user, stdin="hello chat\n")
    assert code == 0, err
    assert "default> You said: hello chat" in out


async def test_a_reply_produced_while_away_is_shown_when_the_user_returns_once(suite: Suite) -> None:
    user = f"away{secrets.token_hex(3)}"
    code, _, err = await parley(suite, "send", "--user", user, "--timeout", "0.5", "please be slow")
    assert code == 1
    assert "no reply within 0.5s" in err
    bus = await suite.connect()
    try:

        async def waiting() -> bool:
            info = await bus.js.consumer_info(
                bus.subjects.stream("OUTBOUND"), terminal_durable(user, DEFAULT_AGENT_ID)
            )
            return bool(info.num_pending)

        await eventually(waiting, timeout=30, what="the late reply in the user's consumer")
        info = await bus.js.consumer_info(
            bus.subjects.stream("OUTBOUND"), terminal_durable(user, DEFAULT_AGENT_ID)
        )
        assert info.config.inactive_threshold == FORGET_AFTER  # removed after a week unread
    finally:
        await bus.close()
    code, out, err = await parley(suite, "chat", "--user", user)
    assert code == 0, err
    assert "default> Sorry for the wait.    (a reply from while you were away)" in out
    code, out, err = await parley(suite, "chat", "--user", user)
    assert code == 0, err
    assert "Sorry for the wait" not in out


async def test_chat_prints_stream_chunks_as_they_arrive(suite: Suite) -> None:
    """Stream chunks (published here by hand while the scripted model takes its time) are printed
    as they arrive, before the complete reply, which follows on its own line because it differs
    from what was shown. (The runtime streams its own chunks of the reply too, after these: they
    land on the same line.)"""
    user = f"streamer{secrets.token_hex(3)}"
    bus = await suite.connect()
    try:
        inbound = bus.subjects.inbound(DEFAULT_AGENT_ID, TERMINAL_SOURCE)
        sub = await bus.js.subscribe(
            inbound, ordered_consumer=True, config=ConsumerConfig(deliver_policy=DeliverPolicy.NEW)
        )
        chat = asyncio.create_task(parley(suite, "chat", "--user", user, stdin="please be very slow\n"))
        while True:
            message = runtime_pb2.InboundMessage.FromString((await sub.next_msg(timeout=30)).data)
            if message.sender_id == user:
                break
        await sub.unsubscribe()
        for sequence, delta in enumerate(["Streamed ", "words"], start=1):
            chunk = runtime_pb2.StreamChunk(
                agent_id=DEFAULT_AGENT_ID,
                source=TERMINAL_SOURCE,
                turn_id="t",
                response_id="r",
                channel_id=message.channel_id,
                in_reply_to=message.message_id,
                sequence=sequence,
                delta=delta,
            )
            await bus.publish_core(
                bus.subjects.ns + f".stream.{DEFAULT_AGENT_ID}.{TERMINAL_SOURCE}", chunk.SerializeToString()
            )
        code, out, err = await chat
    finally:
        await bus.close()
    assert code == 0, err
    streamed_at = out.index("default> Streamed words")
    assert out.index("\ndefault> That took a while.", streamed_at) > streamed_at, out
