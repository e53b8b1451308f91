"""The Slack connector process: the Events API over HTTP (slack-bolt), replies by the Web API.

Environment: ``PARLEY_CONNECTOR_CREDENTIALS`` (the file of ``parley connectors add NAME --agent A
--source slack --out FILE``), ``PARLEY_SLACK_BOT_TOKEN`` and ``PARLEY_SLACK_SIGNING_SECRET`` (never
logged), ``PARLEY_SLACK_API_URL`` (default ``https://slack.com/api/``), the Events API endpoint's
``PARLEY_SLACK_HOST`` (default 127.0.0.1), ``PARLEY_SLACK_PORT`` (default 3000) and
``PARLEY_SLACK_PATH`` (default ``/slack/events``), and the bridge's ``PARLEY_CONNECTOR_STATE``
and ``PARLEY_CONNECTOR_EDIT_INTERVAL``.

Bolt verifies every request's signature (401 otherwise) and answers Slack only after the message
is published (``process_before_response``): a connector that stops before publishing is not
acknowledged, so Slack retries the event. A retry (``X-Slack-Retry-Num``) of an event already
published is answered at once; any other repeat has the same message id, so one answer.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from typing import Any

import aiohttp
from aiohttp import web
from slack_bolt.async_app import AsyncApp
from slack_bolt.context.async_context import AsyncBoltContext
from slack_bolt.request.async_request import AsyncBoltRequest
from slack_sdk.errors import SlackApiError
from slack_sdk.web.async_client import AsyncWebClient

from parley_chat.bridge import Bridge, ConfigError, Intake, require, run_connector
from parley_chat.delivery import ChatPlatform, PlatformError
from parley_platform.logging import get_logger

from .mapping import split_channel, to_inbound

log = get_logger(__name__)

DEFAULT_API_URL = "https://slack.com/api/"
SEEN_EVENTS = 10_000  # event ids remembered for answering retries at once
GONE = {"message_not_found", "cant_update_message", "channel_not_found"}  # no such message any more


class SlackPlatform:
    limit = 40_000  # characters of a message's text

    def __init__(self, client: AsyncWebClient) -> None:
        self.client = client

    async def _call(self, method: str, **params: Any) -> dict[str, Any]:
        try:
            response = await self.client.api_call(method, json=params)
        except SlackApiError as exc:
            error = str(exc.response.get("error", "failed"))
            raise PlatformError(f"{method}: {error}", gone=error in GONE) from None
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise PlatformError(f"{method}: {type(exc).__name__}") from None
        return dict(response.data) if isinstance(response.data, dict) else {}

    async def send(self, channel_id: str, in_reply_to: str, text: str) -> str:
        channel, thread = split_channel(channel_id)
        params: dict[str, Any] = {"channel": channel, "text": text}
        if thread:
            params["thread_ts"] = thread
        found = await self._call("chat.postMessage", **params)
        return str(found.get("ts") or "")

    async def edit(self, channel_id: str, handle: str, text: str) -> None:
        await self._call("chat.update", channel=split_channel(channel_id)[0], ts=handle, text=text)

    async def delete(self, channel_id: str, handle: str) -> None:
        await self._call("chat.delete", channel=split_channel(channel_id)[0], ts=handle)


class EventIntake:
    """The Events API endpoint: Bolt's aiohttp app, its listeners publishing through the bridge."""

    def __init__(self, client: AsyncWebClient, signing_secret: str, host: str, port: int, path: str) -> None:
        self.client = client
        self.signing_secret = signing_secret
        self.host, self.port, self.path = host, port, path
        self.seen: OrderedDict[str, None] = OrderedDict()
        self.retries_answered = 0

    def _remember(self, event_id: str) -> None:
        self.seen[event_id] = None
        while len(self.seen) > SEEN_EVENTS:
            self.seen.popitem(last=False)

    def app(self, bridge: Bridge) -> AsyncApp:
        app = AsyncApp(client=self.client, signing_secret=self.signing_secret, process_before_response=True)

        async def on_message(
            body: dict[str, Any], event: dict[str, Any], request: AsyncBoltRequest, context: AsyncBoltContext
        ) -> None:
            event_id = str(body.get("event_id") or "")
            if request.headers.get("x-slack-retry-num") and event_id in self.seen:
                self.retries_answered += 1
                log.info("slack retry of a published event", event_id=event_id)
                return
            inbound = to_inbound(
                event, bot_user_id=context.bot_user_id or "", team_id=str(body.get("team_id") or "")
            )
            if inbound is not None:
                await bridge.publish(inbound)
            if event_id:
                self._remember(event_id)

        app.event("message")(on_message)
        app.event("app_mention")(on_message)
        return app

    async def __call__(self, bridge: Bridge, stop: asyncio.Event) -> None:
        runner = web.AppRunner(self.app(bridge).web_app(path=self.path, port=self.port), access_log=None)
        await runner.setup()
        try:
            await web.TCPSite(runner, self.host, self.port).start()
            log.info("slack events endpoint listening", host=self.host, port=self.port, path=self.path)
            await stop.wait()
        finally:
            await runner.cleanup()


def make(env: dict[str, str]) -> tuple[ChatPlatform, Intake]:
    token = require(env, "PARLEY_SLACK_BOT_TOKEN")
    secret = require(env, "PARLEY_SLACK_SIGNING_SECRET")
    try:
        port = int(env.get("PARLEY_SLACK_PORT", "3000"))
    except ValueError:
        raise ConfigError("PARLEY_SLACK_PORT must be a port number") from None
    client = AsyncWebClient(token=token, base_url=env.get("PARLEY_SLACK_API_URL") or DEFAULT_API_URL)
    intake = EventIntake(
        client,
        secret,
        env.get("PARLEY_SLACK_HOST", "127.0.0.1"),
        port,
        env.get("PARLEY_SLACK_PATH", "/slack/events"),
    )
    return SlackPlatform(client), intake


def main() -> int:
    return run_connector("slack", make)
