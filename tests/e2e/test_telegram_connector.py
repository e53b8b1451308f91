"""The Telegram connector (python-telegram-bot) as a real process, against a fake Bot API server on
loopback and the real suite (NATS with auth, Postgres, runtime with the scripted model, pairing).

Messages in, replies and edits out; one message, one answer whatever Telegram does: an update
delivered twice, a connector killed between receiving a message and publishing it; a streamed
reply ends with the durable reply's text even when a chunk was lost; a cancelled stream leaves no
message; credentials for another source or agent are refused; the token is never logged.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import secrets
import signal
import sys
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest
from chat_harness import (
    STREAM_ASK,
    STREAMED,
    TELEGRAM_TOKEN,
    Chat,
    publish_reply,
    publish_stream,
    running_chat,
    settle,
)

from parley.v1 import runtime_pb2
from parley_connectors import Connector, Credentials
from parley_devinfra.fake_telegram import BOT_USERNAME, FakeTelegram
from parley_platform.errors import ParleyError
from parley_platform.testing import ServiceProcess, eventually
from support import SessionEnv

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


@pytest.fixture(scope="module")
async def chat(test_env: SessionEnv, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Chat]:
    async with running_chat(test_env, tmp_path_factory.mktemp("telegram")) as found:
        yield found


@pytest.fixture(scope="module")
async def connector(chat: Chat) -> ServiceProcess:
    return await chat.start_telegram()


def new_chat() -> int:
    return 10_000 + secrets.randbelow(10**9)


async def run_once(process: ServiceProcess) -> tuple[int, str]:
    """Run the connector to its end; its exit code and output."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        process.module,
        env=process.env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    out, _ = await asyncio.wait_for(proc.communicate(), 60)
    return proc.returncode or 0, out.decode(errors="replace")


async def answered(chat: Chat, chat_id: int, text: str = "", timeout: float = 30) -> None:
    """Until the chat has a message (whose current text is ``text``, when given: replies stream)."""

    async def check() -> bool:
        sent = chat.telegram.in_chat(chat_id)
        return bool(sent) and (not text or sent[0].text == text)

    await eventually(check, timeout=timeout, what=f"a message {text!r} in chat {chat_id}")


async def test_a_private_message_is_answered_with_one_message(chat: Chat, connector: ServiceProcess) -> None:
    chat_id = new_chat()
    await chat.telegram.push(chat.telegram.message("hello from telegram", chat_id=chat_id))
    await answered(chat, chat_id, "You said: hello from telegram")
    await settle()
    [sent] = chat.telegram.in_chat(chat_id)
    assert sent.text == "You said: hello from telegram"
    assert sent.reply_to is None  # a private chat needs no quote
    assert TELEGRAM_TOKEN not in connector.log(tail=10_000)
    assert TELEGRAM_TOKEN.split(":")[1] not in connector.log(tail=10_000)


async def test_a_reply_streamed_by_the_runtime_is_one_message_edited_as_it_grows(
    chat: Chat, connector: ServiceProcess
) -> None:
    chat_id = new_chat()
    await chat.telegram.push(chat.telegram.message(STREAM_ASK, chat_id=chat_id))

    async def finished() -> bool:
        sent = chat.telegram.in_chat(chat_id)
        return bool(sent) and sent[0].text == STREAMED

    await eventually(finished, timeout=40, what="the streamed reply's final text")
    await settle()
    [sent] = chat.telegram.in_chat(chat_id)
    assert len(sent.texts) >= 3  # sent with the first words, edited as more came
    assert all(STREAMED.startswith(text) for text in sent.texts)  # no tag or thought ever shown


async def test_a_mention_in_a_forum_topic_is_answered_in_that_topic(
    chat: Chat, connector: ServiceProcess
) -> None:
    chat_id = -new_chat()
    text = f"@{BOT_USERNAME} what about topics"
    message = chat.telegram.message(
        text,
        chat_id=chat_id,
        chat_type="supergroup",
        thread_id=77,
        entities=[{"type": "mention", "offset": 0, "length": len(BOT_USERNAME) + 1}],
    )
    await chat.telegram.push(message)
    await answered(chat, chat_id, f"You said: {text}")
    [sent] = chat.telegram.in_chat(chat_id)
    assert (sent.thread_id, sent.reply_to) == (77, message["message_id"])


async def test_an_update_delivered_twice_is_answered_once(chat: Chat, connector: ServiceProcess) -> None:
    chat_id = new_chat()
    message = chat.telegram.message("only once please", chat_id=chat_id)
    await chat.telegram.push(message)
    await chat.telegram.push(message)  # the same message again, in a later update
    await answered(chat, chat_id, "You said: only once please")
    await settle(2.5)
    assert [s.text for s in chat.telegram.in_chat(chat_id)] == ["You said: only once please"]


async def test_a_connector_killed_between_receiving_and_publishing_answers_once(chat: Chat) -> None:
    """The update leaves the Bot API and reaches the connector, which is stopped (SIGSTOP) before it
    can publish, then killed: Telegram has no confirmation, gives the update again to the new
    process, and the agent answers once."""
    creds = await chat.credentials_file("telegram-crash")
    telegram = await FakeTelegram(TELEGRAM_TOKEN).start()  # this connector's bot alone
    try:
        first = await chat.start_telegram(creds, telegram)
        chat_id = new_chat()
        served = asyncio.Event()

        def freeze(updates: list[dict[str, Any]]) -> None:
            if any(u.get("message", {}).get("chat", {}).get("id") == chat_id for u in updates):
                os.kill(first.pid, signal.SIGSTOP)  # before the answer is even written to its socket
                telegram.on_updates_served = None
                served.set()

        telegram.on_updates_served = freeze
        await telegram.push(telegram.message("survive the crash", chat_id=chat_id))
        await asyncio.wait_for(served.wait(), 30)
        first.kill()
        await settle(1.0)
        assert telegram.in_chat(chat_id) == []  # the stopped connector published nothing
        second = await chat.start_telegram(creds, telegram)
        try:
            await eventually(
                lambda: asyncio.sleep(0, bool(telegram.in_chat(chat_id))), timeout=30, what="an answer"
            )
            await settle()
            assert [s.text for s in telegram.in_chat(chat_id)] == ["You said: survive the crash"]
        finally:
            second.stop()
    finally:
        await telegram.stop()


async def test_a_streamed_reply_is_one_message_edited_to_the_durable_text(
    chat: Chat, connector: ServiceProcess
) -> None:
    chat_id = new_chat()
    channel, in_reply_to = str(chat_id), f"{chat_id}:1"
    response_id = await publish_stream(
        chat.operator, "telegram", channel, in_reply_to, [(1, "The answer"), (2, " is"), (4, " LOST")]
    )  # sequence 3 never arrives: the stream is broken and stops editing
    await answered(chat, chat_id)
    await publish_reply(chat.operator, "telegram", response_id, channel, in_reply_to, "The answer is 42.")

    async def final() -> bool:
        return chat.telegram.in_chat(chat_id)[0].text == "The answer is 42."

    await eventually(final, timeout=30, what="the durable reply's text")
    await settle()
    [sent] = chat.telegram.in_chat(chat_id)
    assert sent.texts[0] == "The answer"
    assert "LOST" not in "".join(sent.texts)
    assert sent.texts[-1] == "The answer is 42."


async def test_streamed_edits_are_throttled_and_the_last_text_shown(
    chat: Chat, connector: ServiceProcess
) -> None:
    chat_id = new_chat()
    deltas = [(i, f"w{i} ") for i in range(1, 21)]  # 20 chunks, 50 ms apart, edits at most every 0.2 s
    response_id = await publish_stream(chat.operator, "telegram", str(chat_id), "", deltas)
    full = "".join(d for _, d in deltas)

    async def caught_up() -> bool:
        sent = chat.telegram.in_chat(chat_id)
        return bool(sent) and sent[0].text == full

    await eventually(caught_up, timeout=30, what="the streamed text")
    [sent] = chat.telegram.in_chat(chat_id)
    assert 2 <= len(sent.texts) < len(deltas)
    await publish_reply(chat.operator, "telegram", response_id, str(chat_id), "", full)
    await settle()
    assert len(chat.telegram.in_chat(chat_id)) == 1
    assert chat.telegram.in_chat(chat_id)[0].text == full  # an unchanged final text is not re-sent


async def test_a_cancelled_stream_leaves_no_message(chat: Chat, connector: ServiceProcess) -> None:
    chat_id = new_chat()
    await publish_stream(
        chat.operator, "telegram", str(chat_id), "", [(1, "Half an ans")], outcome="cancelled"
    )

    async def deleted() -> bool:
        sent = chat.telegram.in_chat(chat_id)
        return bool(sent) and sent[0].deleted

    await eventually(deleted, timeout=30, what="the streamed message deleted")


async def test_a_reply_delivered_again_after_a_restart_sends_nothing_more(chat: Chat) -> None:
    """The ledger of delivered replies survives the process: a reply redelivered (its ack lost)
    finds its message already sent."""
    creds = await chat.credentials_file("telegram-ledger")
    telegram = await FakeTelegram(TELEGRAM_TOKEN).start()
    process = await chat.start_telegram(creds, telegram)
    chat_id = new_chat()
    response_id = str(uuid.uuid4())
    await publish_reply(chat.operator, "telegram-ledger", response_id, str(chat_id), "", "Once.")
    await eventually(lambda: asyncio.sleep(0, bool(telegram.in_chat(chat_id))), timeout=30, what="the reply")
    process.stop()
    # The same reply again, under a new JetStream id (as a republish after a lost ack would be seen).
    bus = chat.operator
    again = runtime_pb2.OutboundMessage(
        agent_id=Credentials.load(creds).agent_id,
        source="telegram-ledger",
        response_id=response_id,
        channel_id=str(chat_id),
        text="Once.",
    )
    await bus.publish(
        bus.subjects.outbound(again.agent_id, "telegram-ledger"),
        again.SerializeToString(),
        msg_id=f"{response_id}-again",
    )
    process = await chat.start_telegram(creds, telegram)
    try:
        await settle(3.0)
        assert [s.text for s in telegram.in_chat(chat_id)] == ["Once."]
    finally:
        process.stop()
        await telegram.stop()


async def test_credentials_for_another_source_or_agent_are_refused(chat: Chat) -> None:
    slack_creds = await chat.credentials_file("slack")
    wrong = chat.telegram_process(slack_creds)
    code, output = await run_once(wrong)
    assert code == 2
    assert "for source 'slack', not 'telegram'" in output  # telegram or telegram-<name> only
    assert TELEGRAM_TOKEN not in output

    creds = Credentials.load(await chat.credentials_file("telegram"))
    other_agent = dataclasses.replace(
        creds, agent_id=str(uuid.uuid4()), inbound_subject="", outbound_subject=""
    )
    with pytest.raises(ParleyError):
        await Connector.connect(other_agent)  # its consumer would read another agent's replies


async def test_a_bot_api_that_refuses_the_token_stops_the_connector_clearly(chat: Chat) -> None:
    process = chat.telegram_process(
        await chat.credentials_file("telegram-badtoken"), PARLEY_TELEGRAM_TOKEN="1:wrong-token"
    )
    code, output = await run_once(process)
    assert code == 2
    assert "refused the bot" in output
    assert "wrong-token" not in output


async def test_the_connector_stops_on_sigterm(chat: Chat) -> None:
    telegram = await FakeTelegram(TELEGRAM_TOKEN).start()
    process = await chat.start_telegram(await chat.credentials_file("telegram-stop"), telegram)
    try:
        assert process.stop(timeout=20) == 0
    finally:
        await telegram.stop()
