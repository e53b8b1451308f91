"""The Slack connector (slack-bolt, slack-sdk) as a real process: signed Events API requests from a
fake Slack on loopback, replies through its fake Web API, against the real suite.

Messages in DMs, channels and threads, replies and ``chat.update`` edits out; one message, one
answer when Slack retries an event (``X-Slack-Retry-Num``) or sends a mention as both ``message``
and ``app_mention``; a request with a bad or stale signature is refused with 401 and publishes
nothing; the connector's secrets are never logged.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import signal
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from chat_harness import (
    SLACK_SECRET,
    SLACK_TOKEN,
    STREAM_ASK,
    STREAMED,
    Chat,
    publish_reply,
    publish_stream,
    running_chat,
    settle,
)

from parley_devinfra.fake_slack import BOT_USER
from parley_platform.testing import ServiceProcess, eventually
from support import SessionEnv

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


@pytest.fixture(scope="module")
async def chat(test_env: SessionEnv, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Chat]:
    async with running_chat(test_env, tmp_path_factory.mktemp("slack")) as found:
        yield found


@dataclass
class Running:
    """The module's Slack connector (one per agent and source: each would post every reply)."""

    process: ServiceProcess
    url: str
    creds: Path

    @property
    def port(self) -> int:
        return int(self.url.split(":")[2].split("/")[0])


@pytest.fixture(scope="module")
async def events(chat: Chat) -> AsyncIterator[Running]:
    creds = await chat.credentials_file("slack")
    process, url = await chat.start_slack(creds)
    running = Running(process, url, creds)
    yield running
    running.process.stop()


def channel(prefix: str = "D") -> str:
    return f"{prefix}{secrets.token_hex(4).upper()}"


async def answered(chat: Chat, where: str, text: str = "", timeout: float = 30) -> None:
    """Until the channel has a message (whose current text is ``text``, when given: replies stream)."""

    async def check() -> bool:
        posted = chat.slack.in_channel(where)
        return bool(posted) and (not text or posted[0].text == text)

    await eventually(check, timeout=timeout, what=f"a message {text!r} in {where}")


async def test_a_direct_message_is_answered_once(chat: Chat, events: Running) -> None:
    process, url = events.process, events.url
    dm = channel()
    status = await chat.slack.deliver(
        url, chat.slack.event_body(chat.slack.message("hello from slack", channel=dm))
    )
    assert status == 200
    await answered(chat, dm, "You said: hello from slack")
    await settle()
    [posted] = chat.slack.in_channel(dm)
    assert posted.thread_ts is None
    log = process.log(tail=10_000)
    assert SLACK_TOKEN not in log
    assert SLACK_SECRET not in log


async def test_a_mention_in_a_thread_is_answered_in_the_thread_once(chat: Chat, events: Running) -> None:
    """Slack sends a mention as a ``message`` and an ``app_mention`` event: one message id, one answer."""
    url = events.url
    room, parent = channel("C"), chat.slack.next_ts()
    event = chat.slack.message(
        f"<@{BOT_USER}> how do threads work", channel=room, channel_type="channel", thread_ts=parent
    )
    mention = {**event, "type": "app_mention"}
    assert await chat.slack.deliver(url, chat.slack.event_body(event)) == 200
    assert await chat.slack.deliver(url, chat.slack.event_body(mention)) == 200
    await answered(chat, room, f"You said: <@{BOT_USER}> how do threads work")
    await settle(2.5)
    [posted] = chat.slack.in_channel(room)
    assert posted.thread_ts == parent
    assert posted.text == f"You said: <@{BOT_USER}> how do threads work"


async def test_a_retried_event_is_answered_once(chat: Chat, events: Running) -> None:
    url = events.url
    dm = channel()
    body = chat.slack.event_body(chat.slack.message("did you get this", channel=dm))
    first, retries = await asyncio.gather(
        chat.slack.deliver(url, body),
        asyncio.gather(*(chat.slack.deliver(url, body, retry_num=n) for n in (1, 2))),
    )
    assert [first, *retries] == [200, 200, 200]
    await answered(chat, dm, "You said: did you get this")
    assert await chat.slack.deliver(url, body, retry_num=3) == 200  # after the answer, too
    await settle(2.5)
    assert [p.text for p in chat.slack.in_channel(dm)] == ["You said: did you get this"]


async def test_a_connector_killed_between_receiving_and_publishing_answers_once(
    chat: Chat, events: Running
) -> None:
    """The event reaches the connector's socket while it is stopped (SIGSTOP): Slack gets no answer
    in 3 s; the connector is killed and restarted on the same URL; Slack's retry is answered, once."""
    dm = channel()
    body = chat.slack.event_body(chat.slack.message("after the crash", channel=dm))
    os.kill(events.process.pid, signal.SIGSTOP)
    assert await chat.slack.deliver(events.url, body, timeout=3) == 0  # received, never answered
    events.process.kill()
    await settle(1.0)
    assert chat.slack.in_channel(dm) == []  # the stopped connector published nothing
    events.process, events.url = await chat.start_slack(events.creds, events.port)
    assert await chat.slack.deliver(events.url, body, retry_num=1) == 200
    await answered(chat, dm, "You said: after the crash")
    await settle()
    assert [p.text for p in chat.slack.in_channel(dm)] == ["You said: after the crash"]


async def test_a_bad_or_stale_signature_is_refused(chat: Chat, events: Running) -> None:
    url = events.url
    dm = channel()
    body = chat.slack.event_body(chat.slack.message("forged", channel=dm))
    forged = chat.slack.sign(body, secret="not-the-secret")
    stale = chat.slack.sign(body, timestamp=int(time.time()) - 3600)
    unsigned = {"Content-Type": "application/json"}
    assert await chat.slack.deliver(url, body, headers=forged) == 401
    assert await chat.slack.deliver(url, body, headers=stale) == 401
    assert await chat.slack.deliver(url, body, headers=unsigned) == 401
    await settle(2.0)
    assert chat.slack.in_channel(dm) == []


async def test_a_reply_streamed_by_the_runtime_is_one_message_updated_as_it_grows(
    chat: Chat, events: Running
) -> None:
    url = events.url
    dm = channel()
    assert (
        await chat.slack.deliver(url, chat.slack.event_body(chat.slack.message(STREAM_ASK, channel=dm)))
        == 200
    )

    async def finished() -> bool:
        posted = chat.slack.in_channel(dm)
        return bool(posted) and posted[0].text == STREAMED

    await eventually(finished, timeout=40, what="the streamed reply's final text")
    await settle()
    [posted] = chat.slack.in_channel(dm)
    assert len(posted.texts) >= 3
    assert all(STREAMED.startswith(text) for text in posted.texts)


async def test_a_lost_chunk_never_reaches_the_final_message(chat: Chat, events: Running) -> None:
    dm = channel()
    response_id = await publish_stream(chat.operator, "slack", dm, "", [(1, "Partly"), (3, " WRONG")])
    await answered(chat, dm)
    await publish_reply(chat.operator, "slack", response_id, dm, "", "Partly right, in full.")

    async def final() -> bool:
        return chat.slack.in_channel(dm)[0].text == "Partly right, in full."

    await eventually(final, timeout=30, what="the durable reply's text")
    [posted] = chat.slack.in_channel(dm)
    assert "WRONG" not in "".join(posted.texts)


async def test_a_superseded_stream_is_deleted(chat: Chat, events: Running) -> None:
    dm = channel()
    await publish_stream(chat.operator, "slack", dm, "", [(1, "An answer that")], outcome="superseded")

    async def deleted() -> bool:
        posted = chat.slack.in_channel(dm)
        return bool(posted) and posted[0].deleted

    await eventually(deleted, timeout=30, what="the streamed message deleted")
