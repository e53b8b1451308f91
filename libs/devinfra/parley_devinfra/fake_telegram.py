"""A fake Telegram Bot API server on loopback, for the tests and benchmarks of the Telegram connector.

It speaks the Bot API's HTTP protocol (``POST /bot<token>/<method>``, form or JSON parameters,
``{"ok": ..., "result": ...}`` answers, long polling ``getUpdates`` with confirming offsets), so
the connector runs python-telegram-bot unchanged, pointed here by its ``base_url``. It keeps what
the bot sent (``sent``, ``edits``, ``deletes``) and lets a test push updates, including the same
message twice. A test may also hook ``on_updates_served`` to act the moment updates leave the server
(for instance, to kill the connector between receiving a message and publishing it).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

BOT_ID = 7000001
BOT_USERNAME = "parley_test_bot"


@dataclass
class Sent:
    """A message the bot sent, with every text it was edited to (``texts[-1]`` is the current one)."""

    chat_id: int
    message_id: int
    texts: list[str]
    reply_to: int | None = None
    thread_id: int | None = None
    deleted: bool = False

    @property
    def text(self) -> str:
        return self.texts[-1]


@dataclass
class FakeTelegram:
    token: str
    host: str = "127.0.0.1"
    port: int = 0
    updates: list[dict[str, Any]] = field(default_factory=list)
    sent: list[Sent] = field(default_factory=list)
    calls: list[str] = field(default_factory=list)  # every method called, in order
    on_updates_served: Callable[[list[dict[str, Any]]], None] | None = None
    on_sent: Callable[[Sent], None] | None = None  # called for each message the bot sends
    _runner: web.AppRunner | None = None
    _arrived: asyncio.Condition = field(default_factory=asyncio.Condition)
    _update_ids: itertools.count[int] = field(default_factory=lambda: itertools.count(100))
    _message_ids: itertools.count[int] = field(default_factory=lambda: itertools.count(5000))

    @property
    def base_url(self) -> str:
        """What python-telegram-bot takes as ``base_url`` (it appends the token and the method)."""
        return f"http://{self.host}:{self.port}/bot"

    async def start(self) -> FakeTelegram:
        app = web.Application()
        app.router.add_route("*", "/bot{token}/{method}", self._handle)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        self.port = self._runner.addresses[0][1]
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    # What a test does: users write, the test looks at what the bot sent.

    async def push(self, message: dict[str, Any], *, kind: str = "message") -> dict[str, Any]:
        """Deliver an update carrying ``message`` (a Bot API Message object); returns the update."""
        update = {"update_id": next(self._update_ids), kind: message}
        async with self._arrived:
            self.updates.append(update)
            self._arrived.notify_all()
        return update

    def message(
        self,
        text: str,
        *,
        chat_id: int = 1001,
        chat_type: str = "private",
        user_id: int = 42,
        first_name: str = "Ann",
        username: str = "ann",
        message_id: int | None = None,
        thread_id: int | None = None,
        reply_to: dict[str, Any] | None = None,
        entities: list[dict[str, Any]] | None = None,
    ) -> dict[str, Any]:
        """A Bot API Message object, as a user's client produces it."""
        chat: dict[str, Any] = {"id": chat_id, "type": chat_type}
        if chat_type == "private":
            chat.update(first_name=first_name, username=username)
        else:
            chat["title"] = f"chat {chat_id}"
        found: dict[str, Any] = {
            "message_id": message_id if message_id is not None else next(self._message_ids),
            "date": int(time.time()),
            "chat": chat,
            "text": text,
        }
        if chat_type != "channel":
            found["from"] = {"id": user_id, "is_bot": False, "first_name": first_name, "username": username}
        if thread_id is not None:
            found.update(message_thread_id=thread_id, is_topic_message=True)
        if reply_to is not None:
            found["reply_to_message"] = reply_to
        if entities:
            found["entities"] = entities
        return found

    def in_chat(self, chat_id: int) -> list[Sent]:
        return [s for s in self.sent if s.chat_id == chat_id]

    # The Bot API.

    async def _handle(self, request: web.Request) -> web.Response:
        if request.match_info["token"] != self.token:
            return _error(401, "Unauthorized")
        method = request.match_info["method"]
        self.calls.append(method)
        params = await _params(request)
        handler = getattr(self, f"_api_{method}", None)
        if handler is None:
            return _error(404, "Not Found: method not found")
        result: Any = await handler(params)
        if isinstance(result, web.Response):
            return result
        return web.json_response({"ok": True, "result": result})

    async def _api_getMe(self, params: dict[str, Any]) -> dict[str, Any]:
        return {"id": BOT_ID, "is_bot": True, "first_name": "Parley", "username": BOT_USERNAME}

    async def _api_deleteWebhook(self, params: dict[str, Any]) -> bool:
        return True

    async def _api_getUpdates(self, params: dict[str, Any]) -> list[dict[str, Any]]:
        offset = int(params.get("offset") or 0)
        timeout = float(params.get("timeout") or 0)
        limit = int(params.get("limit") or 100)
        async with self._arrived:
            # Confirming an offset forgets every update before it, as Telegram does.
            self.updates = [u for u in self.updates if u["update_id"] >= offset]
            if not self.updates and timeout > 0:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._arrived.wait(), timeout)
            served = self.updates[:limit]
        if served and self.on_updates_served is not None:
            self.on_updates_served(served)
        return served

    async def _api_sendMessage(self, params: dict[str, Any]) -> dict[str, Any] | web.Response:
        text = str(params.get("text") or "")
        if not text.strip():
            return _error(400, "Bad Request: message text is empty")
        if len(text) > 4096:
            return _error(400, "Bad Request: message is too long")
        reply = params.get("reply_parameters")
        reply_to = (reply or {}).get("message_id") if isinstance(reply, dict) else None
        thread = params.get("message_thread_id")
        sent = Sent(
            int(params["chat_id"]),
            next(self._message_ids),
            [text],
            reply_to=int(reply_to) if reply_to is not None else None,
            thread_id=int(thread) if thread is not None else None,
        )
        self.sent.append(sent)
        if self.on_sent is not None:
            self.on_sent(sent)
        return self._message_of(sent)

    async def _api_editMessageText(self, params: dict[str, Any]) -> dict[str, Any] | web.Response:
        sent = self._find(params)
        if sent is None:
            return _error(400, "Bad Request: message to edit not found")
        text = str(params.get("text") or "")
        if text == sent.text:
            return _error(400, "Bad Request: message is not modified")
        if not text.strip() or len(text) > 4096:
            return _error(400, "Bad Request: message text is empty or too long")
        sent.texts.append(text)
        return self._message_of(sent)

    async def _api_deleteMessage(self, params: dict[str, Any]) -> bool | web.Response:
        sent = self._find(params)
        if sent is None:
            return _error(400, "Bad Request: message to delete not found")
        sent.deleted = True
        return True

    def _find(self, params: dict[str, Any]) -> Sent | None:
        chat, message = int(params.get("chat_id") or 0), int(params.get("message_id") or 0)
        return next(
            (s for s in self.sent if s.chat_id == chat and s.message_id == message and not s.deleted), None
        )

    @staticmethod
    def _message_of(sent: Sent) -> dict[str, Any]:
        chat_type = "private" if sent.chat_id > 0 else "supergroup"
        return {
            "message_id": sent.message_id,
            "date": int(time.time()),
            "chat": {"id": sent.chat_id, "type": chat_type},
            "from": {"id": BOT_ID, "is_bot": True, "first_name": "Parley", "username": BOT_USERNAME},
            "text": sent.text,
        }


async def _params(request: web.Request) -> dict[str, Any]:
    """The method's parameters: JSON, or form fields whose objects are JSON-encoded (the Bot API's two
    ways, python-telegram-bot uses the second)."""
    if request.content_type == "application/json":
        body = await request.json() if request.can_read_body else {}
        return dict(body)
    form = await request.post()
    found: dict[str, Any] = {}
    for key, value in form.items():
        text = value if isinstance(value, str) else ""
        try:
            found[key] = json.loads(text) if text[:1] in "{[" else text
        except json.JSONDecodeError:
            found[key] = text
    return found


def _error(code: int, description: str) -> web.Response:
    return web.json_response({"ok": False, "error_code": code, "description": description}, status=code)
