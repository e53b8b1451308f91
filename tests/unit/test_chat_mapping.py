"""Telegram and Slack messages onto Parley rooms (room type, channel, world, mentions, reply-to), with
the platforms' own message objects (python-telegram-bot's ``Message.de_json``; Slack event JSON)."""

from __future__ import annotations

from typing import Any

import pytest
from telegram import Bot, Message, User

from parley_devinfra.fake_slack import BOT_USER, TEAM, FakeSlack
from parley_devinfra.fake_telegram import BOT_ID, BOT_USERNAME, FakeTelegram
from parley_slack.mapping import split_channel as slack_split
from parley_slack.mapping import to_inbound as slack_inbound
from parley_telegram.mapping import split_channel as telegram_split
from parley_telegram.mapping import to_inbound as telegram_inbound

ME = User(BOT_ID, "Parley", is_bot=True, username=BOT_USERNAME)
TG = FakeTelegram("1:x")
SLACK = FakeSlack("xoxb", "secret")


def tg(data: dict[str, Any]) -> Message:
    message = Message.de_json(data, Bot("1:x"))
    assert message is not None
    return message


def test_a_private_chat_is_a_dm_room() -> None:
    found = telegram_inbound(tg(TG.message("hi", chat_id=55, message_id=9)), ME)
    assert found is not None
    assert (found.message_id, found.channel_id, found.room_type, found.world_id) == ("55:9", "55", "dm", "")
    assert (found.sender_id, found.sender_name, found.sender_username) == ("42", "Ann", "ann")
    assert not found.mentions_agent


def test_a_group_message_is_a_group_room_mentioning_only_when_addressed() -> None:
    plain = telegram_inbound(tg(TG.message("hi all", chat_id=-100, chat_type="supergroup")), ME)
    assert plain is not None
    assert (plain.room_type, plain.channel_id, plain.world_id, plain.mentions_agent) == (
        "group",
        "-100",
        "-100",
        False,
    )
    other = f"@someone_else hi @{BOT_USERNAME}"
    entities = [
        {"type": "mention", "offset": 0, "length": 13},
        {"type": "mention", "offset": 17, "length": len(BOT_USERNAME) + 1},
    ]
    addressed = telegram_inbound(
        tg(TG.message(other, chat_id=-100, chat_type="group", entities=entities)), ME
    )
    assert addressed is not None
    assert addressed.mentions_agent
    only_other = telegram_inbound(
        tg(TG.message("@someone_else hi", chat_id=-100, chat_type="group", entities=entities[:1])), ME
    )
    assert only_other is not None
    assert not only_other.mentions_agent


@pytest.mark.parametrize(
    "entity",
    [
        {
            "type": "text_mention",
            "offset": 0,
            "length": 6,
            "user": {"id": BOT_ID, "is_bot": True, "first_name": "Parley"},
        },
        {"type": "bot_command", "offset": 0, "length": 6 + len(BOT_USERNAME) + 1},
    ],
)
def test_text_mentions_and_commands_address_the_bot(entity: dict[str, Any]) -> None:
    text = f"/start@{BOT_USERNAME}" if entity["type"] == "bot_command" else "Parley, hello"
    found = telegram_inbound(tg(TG.message(text, chat_id=-7, chat_type="group", entities=[entity])), ME)
    assert found is not None
    assert found.mentions_agent


def test_a_reply_to_the_bot_addresses_it_and_names_the_message() -> None:
    bots = {"message_id": 3, "date": 0, "chat": {"id": -7, "type": "group"}, "text": "earlier",
            "from": {"id": BOT_ID, "is_bot": True, "first_name": "Parley"}}  # fmt: skip
    found = telegram_inbound(tg(TG.message("and then?", chat_id=-7, chat_type="group", reply_to=bots)), ME)
    assert found is not None
    assert (found.in_reply_to, found.mentions_agent) == ("-7:3", True)


def test_a_forum_topic_is_a_thread_room_of_its_group() -> None:
    found = telegram_inbound(
        tg(TG.message("in a topic", chat_id=-100, chat_type="supergroup", thread_id=12)), ME
    )
    assert found is not None
    assert (found.room_type, found.channel_id, found.world_id) == ("thread", "-100:12", "-100")
    assert telegram_split(found.channel_id) == (-100, 12)
    assert telegram_split("55") == (55, None)


def test_a_channel_post_is_a_feed_and_the_bots_own_messages_are_skipped() -> None:
    post = telegram_inbound(tg(TG.message("news", chat_id=-300, chat_type="channel")), ME)
    assert post is not None
    assert (post.room_type, post.sender_id) == ("feed", "-300")
    own = TG.message("mine", chat_id=55)
    own["from"] = {"id": BOT_ID, "is_bot": True, "first_name": "Parley"}
    assert telegram_inbound(tg(own), ME) is None
    empty = TG.message("", chat_id=55)
    del empty["text"]
    assert telegram_inbound(tg(empty), ME) is None  # a service message: nothing to answer


def test_a_telegram_document_is_an_attachment() -> None:
    data = TG.message("", chat_id=55)
    del data["text"]
    data.update(
        caption="see this",
        document={
            "file_id": "F1",
            "file_unique_id": "u",
            "file_name": "a.pdf",
            "mime_type": "application/pdf",
        },
    )
    found = telegram_inbound(tg(data), ME)
    assert found is not None
    assert found.text == "see this"
    assert [(a.id, a.title, a.content_type) for a in found.attachments] == [
        ("F1", "a.pdf", "application/pdf")
    ]


def slack(event: dict[str, Any]) -> Any:
    return slack_inbound(event, bot_user_id=BOT_USER, team_id=TEAM)


def test_slack_dms_channels_and_threads() -> None:
    dm = slack(SLACK.message("hi", channel="D1", ts="1.000001"))
    assert (dm.message_id, dm.channel_id, dm.room_type, dm.world_id) == ("D1:1.000001", "D1", "dm", TEAM)
    room = slack(SLACK.message(f"hey <@{BOT_USER}>", channel="C1", channel_type="channel"))
    assert (room.room_type, room.mentions_agent) == ("group", True)
    group_dm = slack(SLACK.message("all of us", channel="G1", channel_type="mpim"))
    assert (group_dm.room_type, group_dm.mentions_agent) == ("group", False)
    thread = slack(
        SLACK.message("in thread", channel="C1", channel_type="channel", ts="2.5", thread_ts="2.1")
    )
    assert (thread.room_type, thread.channel_id, thread.in_reply_to) == ("thread", "C1:2.1", "C1:2.1")
    assert slack_split(thread.channel_id) == ("C1", "2.1")
    parent = slack(SLACK.message("parent", channel="C1", channel_type="channel", ts="2.1", thread_ts="2.1"))
    assert parent.room_type == "group"  # a thread's parent is a channel message


def test_slack_app_mentions_and_what_is_skipped() -> None:
    mention = slack({**SLACK.message("hello", channel="C1", channel_type="channel"), "type": "app_mention"})
    assert mention.mentions_agent
    assert slack({**SLACK.message("joined", channel="C1"), "subtype": "channel_join"}) is None
    assert slack({**SLACK.message("a bot", channel="C1"), "bot_id": "B2"}) is None
    assert slack(SLACK.message("mine", channel="C1", user=BOT_USER)) is None
    edited = slack({**SLACK.message("", channel="C1"), "subtype": "message_changed"})
    assert edited is None
    file = {"id": "F1", "name": "a.png", "mimetype": "image/png", "url_private": "https://x/a.png"}
    shared = slack({**SLACK.message("", channel="D1"), "subtype": "file_share", "files": [file]})
    assert [(a.id, a.title, a.content_type) for a in shared.attachments] == [("F1", "a.png", "image/png")]
