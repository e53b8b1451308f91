"""The Telegram connector process: long polling with python-telegram-bot, one message per reply.

Environment: ``PARLEY_CONNECTOR_CREDENTIALS`` (the file of ``parley connectors add NAME --agent A
--source telegram --out FILE``), ``PARLEY_TELEGRAM_TOKEN`` (the bot's token, never logged),
``PARLEY_TELEGRAM_API_URL`` (default ``https://api.telegram.org/bot``; a Bot API server of one's
own or the tests' fake), ``PARLEY_TELEGRAM_POLL_SECONDS`` (long polling, default 25), and the
bridge's ``PARLEY_CONNECTOR_STATE`` and ``PARLEY_CONNECTOR_EDIT_INTERVAL``.

Updates are confirmed to Telegram (the next ``getUpdates`` offset) only after their messages are
published, so a connector that stops between receiving a message and publishing it receives it
again; the message id makes the second publish a repeat.
"""

from __future__ import annotations

import asyncio

from telegram import Bot, ReplyParameters
from telegram.error import BadRequest, NetworkError, TelegramError

from parley_chat.bridge import Bridge, ConfigError, Intake, require, run_connector
from parley_chat.delivery import ChatPlatform, PlatformError
from parley_platform.logging import get_logger

from .mapping import split_channel, to_inbound

log = get_logger(__name__)

DEFAULT_API_URL = "https://api.telegram.org/bot"
ALLOWED_UPDATES = ["message", "channel_post"]


class TelegramPlatform:
    limit = 4096  # characters of a message's text

    def __init__(self, bot: Bot, token: str) -> None:
        self.bot = bot
        self._token = token
        self._ready = asyncio.Lock()
        self._initialized = False

    async def ready(self) -> Bot:
        """The bot, its HTTP clients started (once, by whichever part uses it first)."""
        async with self._ready:
            if not self._initialized:
                try:
                    await self.bot.initialize()
                except TelegramError as exc:
                    raise self._error(exc) from None
                self._initialized = True
        return self.bot

    def _error(self, exc: TelegramError) -> PlatformError:
        gone = isinstance(exc, BadRequest) and "not found" in exc.message.lower()
        reason = f"{type(exc).__name__}: {exc.message}".replace(self._token, "<token>")
        return PlatformError(reason, gone=gone)

    async def send(self, channel_id: str, in_reply_to: str, text: str) -> str:
        chat, topic = split_channel(channel_id)
        reply = None
        replied_chat, _, replied = in_reply_to.partition(":")
        if chat < 0 and replied and replied_chat == str(chat):  # quote the question in groups only
            reply = ReplyParameters(message_id=int(replied), allow_sending_without_reply=True)
        try:
            sent = await (await self.ready()).send_message(
                chat, text, message_thread_id=topic, reply_parameters=reply
            )
        except TelegramError as exc:
            raise self._error(exc) from None
        return str(sent.message_id)

    async def edit(self, channel_id: str, handle: str, text: str) -> None:
        chat, _ = split_channel(channel_id)
        try:
            await (await self.ready()).edit_message_text(text, chat_id=chat, message_id=int(handle))
        except BadRequest as exc:
            if "not modified" not in exc.message.lower():
                raise self._error(exc) from None
        except TelegramError as exc:
            raise self._error(exc) from None

    async def delete(self, channel_id: str, handle: str) -> None:
        chat, _ = split_channel(channel_id)
        try:
            await (await self.ready()).delete_message(chat, int(handle))
        except TelegramError as exc:
            raise self._error(exc) from None


def poller(platform: TelegramPlatform, poll_seconds: int) -> Intake:
    async def poll(bridge: Bridge, stop: asyncio.Event) -> None:
        try:
            bot = await platform.ready()
            me = await bot.get_me()
        except (TelegramError, PlatformError) as exc:
            raise ConfigError(f"the Telegram Bot API refused the bot: {type(exc).__name__}") from None
        log.info("telegram bot polling", bot=me.username)
        offset: int | None = None
        failures = 0
        while not stop.is_set():
            try:
                updates = await bot.get_updates(
                    offset=offset, timeout=poll_seconds, allowed_updates=ALLOWED_UPDATES
                )
                failures = 0
            except NetworkError as exc:
                failures += 1
                log.warning("getUpdates failed", error=type(exc).__name__, failures=failures)
                await asyncio.sleep(min(30.0, 0.5 * 2**failures))
                continue
            for update in updates:
                message = update.message or update.channel_post
                inbound = to_inbound(message, me) if message is not None else None
                if inbound is not None:
                    await bridge.publish(inbound)  # before the offset moves past it
                offset = update.update_id + 1

    return poll


def make(env: dict[str, str]) -> tuple[ChatPlatform, Intake]:
    token = require(env, "PARLEY_TELEGRAM_TOKEN")
    try:
        poll_seconds = int(env.get("PARLEY_TELEGRAM_POLL_SECONDS", "25"))
    except ValueError:
        raise ConfigError("PARLEY_TELEGRAM_POLL_SECONDS must be whole seconds") from None
    bot = Bot(token, base_url=env.get("PARLEY_TELEGRAM_API_URL") or DEFAULT_API_URL)
    platform = TelegramPlatform(bot, token)
    return platform, poller(platform, poll_seconds)


def main() -> int:
    return run_connector("telegram", make)
