"""Telegram messages as Parley inbound messages: chats, groups, forum topics and channels onto rooms.

- a private chat is a ``dm`` room, its channel the chat id;
- a group or supergroup is a ``group`` room (world: the chat), a forum topic in it a ``thread``
  room whose channel is ``<chat>:<topic>``;
- a channel's posts are a ``feed`` room.

The message id is ``<chat>:<message>`` (Telegram numbers messages per chat), so a message
delivered twice, or again after a restart, has one id and gets one answer. The agent is mentioned
by ``@its_username``, a text mention of it, ``/command@its_username``, or a reply to its message.
"""

from __future__ import annotations

from telegram import Message, MessageEntity, User
from telegram.constants import ChatType

from parley_connectors import Attachment, Inbound, RoomType


def channel_of(message: Message) -> tuple[str, RoomType, str]:
    """(channel_id, room type, world_id) of the room the message was written in."""
    chat = message.chat
    if chat.type == ChatType.PRIVATE:
        return str(chat.id), "dm", ""
    if chat.type == ChatType.CHANNEL:
        return str(chat.id), "feed", str(chat.id)
    if message.is_topic_message and message.message_thread_id:
        return f"{chat.id}:{message.message_thread_id}", "thread", str(chat.id)
    return str(chat.id), "group", str(chat.id)


def split_channel(channel_id: str) -> tuple[int, int | None]:
    """The chat id and forum topic of a channel id made by ``channel_of``."""
    chat, _, topic = channel_id.partition(":")
    return int(chat), (int(topic) if topic else None)


def mentions(message: Message, bot: User) -> bool:
    replied = message.reply_to_message
    if replied is not None and replied.from_user is not None and replied.from_user.id == bot.id:
        return True
    handle = f"@{bot.username}".lower() if bot.username else ""
    kinds: list[str | None] = [MessageEntity.MENTION, MessageEntity.TEXT_MENTION, MessageEntity.BOT_COMMAND]
    found = {**message.parse_entities(kinds), **message.parse_caption_entities(kinds)}
    for entity, text in found.items():
        if entity.type == MessageEntity.TEXT_MENTION and entity.user is not None and entity.user.id == bot.id:
            return True
        if handle and entity.type == MessageEntity.MENTION and text.lower() == handle:
            return True
        if handle and entity.type == MessageEntity.BOT_COMMAND and text.lower().endswith(handle):
            return True
    return False


def attachments(message: Message) -> list[Attachment]:
    found: list[Attachment] = []
    if message.photo:
        largest = message.photo[-1]
        found.append(Attachment(id=largest.file_id, title="photo", content_type="image/jpeg"))
    for item, kind in (
        (message.document, "document"),
        (message.audio, "audio"),
        (message.video, "video"),
        (message.voice, "voice"),
    ):
        if item is not None:
            found.append(
                Attachment(
                    id=item.file_id,
                    title=getattr(item, "file_name", None) or kind,
                    content_type=getattr(item, "mime_type", None) or "",
                )
            )
    return found


def to_inbound(message: Message, bot: User) -> Inbound | None:
    """The inbound message, or None for what is not for the agent (its own messages, service
    messages without text or files)."""
    sender = message.from_user
    if sender is not None and sender.id == bot.id:
        return None
    text = message.text or message.caption or ""
    files = attachments(message)
    if not text and not files:
        return None
    channel_id, room_type, world_id = channel_of(message)
    if sender is not None:
        sender_id, name, username = str(sender.id), sender.full_name, sender.username or ""
    elif message.sender_chat is not None:
        sender_id, name, username = str(message.sender_chat.id), message.sender_chat.title or "", ""
    else:
        sender_id, name, username = str(message.chat.id), message.chat.title or "", ""
    replied = message.reply_to_message
    in_reply_to = ""
    if replied is not None and replied.forum_topic_created is None:  # a topic's root is no reply
        in_reply_to = f"{message.chat.id}:{replied.message_id}"
    return Inbound(
        message_id=f"{message.chat.id}:{message.message_id}",
        sender_id=sender_id,
        sender_name=name,
        sender_username=username,
        text=text,
        channel_id=channel_id,
        room_type=room_type,
        world_id=world_id,
        mentions_agent=mentions(message, bot),
        in_reply_to=in_reply_to,
        attachments=files,
        metadata={"telegram_chat_type": str(message.chat.type)},
        sent_at=message.date,
    )
