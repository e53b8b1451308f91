"""A fake Slack: the Web API (``POST /api/<method>`` with a bot token) and the Events API's sender
(signed ``event_callback`` requests, retried with ``X-Slack-Retry-Num``), on loopback.

slack-sdk's ``AsyncWebClient`` is pointed here by its ``base_url``; the connector's Events API
endpoint receives what ``deliver`` sends, signed with the app's signing secret exactly as Slack
signs (``v0=`` HMAC-SHA256 of ``v0:<timestamp>:<body>``).
"""

from __future__ import annotations

import hashlib
import hmac
import itertools
import json
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web

BOT_USER = "U0PARLEY"
BOT_ID = "B0PARLEY"
TEAM = "T0PARLEY"


@dataclass
class Posted:
    """A message the bot posted, with every text it was updated to (``texts[-1]`` is the current)."""

    channel: str
    ts: str
    texts: list[str]
    thread_ts: str | None = None
    deleted: bool = False

    @property
    def text(self) -> str:
        return self.texts[-1]


@dataclass
class FakeSlack:
    token: str
    signing_secret: str
    host: str = "127.0.0.1"
    port: int = 0
    posted: list[Posted] = field(default_factory=list)
    calls: list[str] = field(default_factory=list)
    _runner: web.AppRunner | None = None
    _ts: itertools.count[int] = field(default_factory=lambda: itertools.count(1))

    @property
    def base_url(self) -> str:
        """What slack-sdk takes as ``base_url``."""
        return f"http://{self.host}:{self.port}/api/"

    async def start(self) -> FakeSlack:
        app = web.Application()
        app.router.add_post("/api/{method}", self._handle)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, self.host, self.port).start()
        self.port = self._runner.addresses[0][1]
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    def in_channel(self, channel: str) -> list[Posted]:
        return [p for p in self.posted if p.channel == channel]

    def next_ts(self) -> str:
        return f"{int(time.time())}.{next(self._ts):06d}"

    # The Events API: what Slack sends to the app's request URL.

    def event_body(self, event: dict[str, Any], *, event_id: str | None = None) -> bytes:
        envelope = {
            "token": "verification-token-unused",
            "team_id": TEAM,
            "api_app_id": "A0PARLEY",
            "event": event,
            "type": "event_callback",
            "event_id": event_id or f"Ev{secrets.token_hex(5).upper()}",
            "event_time": int(time.time()),
            "authorizations": [{"team_id": TEAM, "user_id": BOT_USER, "is_bot": True}],
        }
        return json.dumps(envelope).encode()

    def sign(self, body: bytes, timestamp: int | None = None, secret: str | None = None) -> dict[str, str]:
        stamp = str(timestamp if timestamp is not None else int(time.time()))
        base = f"v0:{stamp}:".encode() + body
        digest = hmac.new((secret or self.signing_secret).encode(), base, hashlib.sha256).hexdigest()
        return {
            "Content-Type": "application/json",
            "X-Slack-Request-Timestamp": stamp,
            "X-Slack-Signature": f"v0={digest}",
        }

    async def deliver(
        self,
        url: str,
        body: bytes,
        *,
        retry_num: int = 0,
        headers: dict[str, str] | None = None,
        timeout: float = 30.0,
    ) -> int:
        """POST one event request (signed unless ``headers`` are given); returns the HTTP status, or
        0 when the app does not answer within ``timeout`` (Slack gives up after 3 s and retries)."""
        sent = dict(headers if headers is not None else self.sign(body))
        if retry_num:
            sent.update({"X-Slack-Retry-Num": str(retry_num), "X-Slack-Retry-Reason": "http_timeout"})
        limit = aiohttp.ClientTimeout(total=timeout)
        try:
            async with (
                aiohttp.ClientSession(timeout=limit) as session,
                session.post(url, data=body, headers=sent) as response,
            ):
                await response.read()
                return response.status
        except TimeoutError:
            return 0

    def message(
        self,
        text: str,
        *,
        channel: str = "D0001",
        channel_type: str = "im",
        user: str = "U0ANN",
        ts: str | None = None,
        thread_ts: str | None = None,
    ) -> dict[str, Any]:
        """A ``message`` event as Slack sends it."""
        event: dict[str, Any] = {
            "type": "message",
            "channel": channel,
            "channel_type": channel_type,
            "user": user,
            "text": text,
            "ts": ts or self.next_ts(),
            "team": TEAM,
        }
        if thread_ts:
            event["thread_ts"] = thread_ts
        return event

    # The Web API.

    async def _handle(self, request: web.Request) -> web.Response:
        method = request.match_info["method"]
        self.calls.append(method)
        if request.headers.get("Authorization") != f"Bearer {self.token}":
            return web.json_response({"ok": False, "error": "invalid_auth"})
        if request.content_type == "application/json":
            params: dict[str, Any] = dict(await request.json())
        else:
            params = {k: v for k, v in (await request.post()).items() if isinstance(v, str)}
        handler = getattr(self, "_api_" + method.replace(".", "_"), None)
        if handler is None:
            return web.json_response({"ok": False, "error": "unknown_method"})
        return web.json_response({"ok": True, **await handler(params)})

    async def _api_auth_test(self, params: dict[str, Any]) -> dict[str, Any]:
        return {
            "url": "https://parley-test.slack.com/",
            "team": "Parley",
            "user": "parley",
            "team_id": TEAM,
            "user_id": BOT_USER,
            "bot_id": BOT_ID,
        }

    async def _api_chat_postMessage(self, params: dict[str, Any]) -> dict[str, Any]:
        posted = Posted(str(params["channel"]), self.next_ts(), [str(params.get("text") or "")])
        posted.thread_ts = params.get("thread_ts") or None
        self.posted.append(posted)
        return {"channel": posted.channel, "ts": posted.ts, "message": {"text": posted.text}}

    async def _api_chat_update(self, params: dict[str, Any]) -> dict[str, Any]:
        posted = self._find(params)
        if posted is None:
            return {"ok": False, "error": "message_not_found"}
        posted.texts.append(str(params.get("text") or ""))
        return {"channel": posted.channel, "ts": posted.ts, "text": posted.text}

    async def _api_chat_delete(self, params: dict[str, Any]) -> dict[str, Any]:
        posted = self._find(params)
        if posted is None:
            return {"ok": False, "error": "message_not_found"}
        posted.deleted = True
        return {"channel": posted.channel, "ts": posted.ts}

    def _find(self, params: dict[str, Any]) -> Posted | None:
        channel, ts = str(params.get("channel")), str(params.get("ts"))
        return next((p for p in self.posted if p.channel == channel and p.ts == ts and not p.deleted), None)
