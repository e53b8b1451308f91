"""Slack message events as Parley inbound messages: DMs, channels and threads onto rooms.

- a DM (``channel_type`` im) is a ``dm`` room, its channel the conversation id;
- a channel, private channel or group DM is a ``group`` room (world: the workspace);
- a reply in a thread is a ``thread`` room whose channel is ``<channel>:<thread_ts>``, answering
  the thread's parent message.

The message id is ``<channel>:<ts>`` (a message's ts is unique within its channel): an event Slack
retries, or the same message arriving as both ``message`` and ``app_mention``, has one id and gets
one answer. The agent is mentioned by ``<@its user id>`` (or an ``app_mention`` event).
"""

from __future__ import annotations

from typing import Any

from parley_connectors import Attachment, Inbound, RoomType

# Message subtypes that are people writing; the rest (joins, edits, deletions, bots) are not.
PEOPLE_SUBTYPES = {None, "", "file_share", "thread_broadcast"}


def channel_of(event: dict[str, Any]) -> tuple[str, RoomType, str]:
    """(channel_id, room type, in_reply_to) of the room the message was written in."""
    channel = str(event.get("channel") or "")
    ts, thread_ts = str(event.get("ts") or ""), str(event.get("thread_ts") or "")
    if thread_ts and thread_ts != ts:
        return f"{channel}:{thread_ts}", "thread", f"{channel}:{thread_ts}"
    if event.get("channel_type") == "im":
        return channel, "dm", ""
    return channel, "group", ""


def split_channel(channel_id: str) -> tuple[str, str | None]:
    """The conversation and thread of a channel id made by ``channel_of``."""
    channel, _, thread = channel_id.partition(":")
    return channel, thread or None


def sender_name(event: dict[str, Any]) -> str:
    profile = event.get("user_profile") or {}
    return str(profile.get("display_name") or profile.get("real_name") or event.get("user") or "")


def to_inbound(event: dict[str, Any], *, bot_user_id: str, team_id: str) -> Inbound | None:
    """The inbound message, or None for what is not a person writing to the agent."""
    if event.get("subtype") not in PEOPLE_SUBTYPES or event.get("bot_id"):
        return None
    user = str(event.get("user") or "")
    if not user or user == bot_user_id or not event.get("channel") or not event.get("ts"):
        return None
    files = [
        Attachment(
            id=str(f.get("id") or ""),
            url=str(f.get("url_private") or ""),
            title=str(f.get("name") or f.get("title") or ""),
            content_type=str(f.get("mimetype") or ""),
        )
        for f in event.get("files") or []
        if isinstance(f, dict)
    ]
    text = str(event.get("text") or "")
    if not text and not files:
        return None
    channel_id, room_type, in_reply_to = channel_of(event)
    mentioned = event.get("type") == "app_mention" or (bool(bot_user_id) and f"<@{bot_user_id}>" in text)
    return Inbound(
        message_id=f"{event['channel']}:{event['ts']}",
        sender_id=user,
        sender_name=sender_name(event),
        sender_username=str((event.get("user_profile") or {}).get("name") or ""),
        text=text,
        channel_id=channel_id,
        room_type=room_type,
        world_id=str(event.get("team") or team_id),
        mentions_agent=mentioned,
        in_reply_to=in_reply_to,
        attachments=files,
        metadata={"slack_channel_type": str(event.get("channel_type") or "")},
    )
