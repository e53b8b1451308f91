"""A chat platform's connector process: the platform's intake publishing through the connector kit,
and the agent's replies and stream chunks delivered to the platform as one message each.

``run_connector("telegram", make_platform)`` is the whole ``main`` of a connector: it reads the
connector's credentials (``PARLEY_CONNECTOR_CREDENTIALS``, the file of ``parley connectors add``),
refuses credentials issued for another platform's source (``telegram`` or ``telegram-<anything>``
for a second bot of the same agent: every connector of one agent and source receives every reply
for that source), connects as that connector, and runs until SIGTERM.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path

from parley_connectors import Connector, Credentials, Inbound
from parley_platform.errors import ParleyError
from parley_platform.lifecycle import ShutdownSignal
from parley_platform.logging import configure, get_logger

from .delivery import ChatPlatform, Delivery, Ledger, PlatformError

log = get_logger(__name__)

# Libraries that log request URLs (a Telegram token is part of its URLs) stay at WARNING.
QUIET_LOGGERS = ("httpx", "httpcore", "telegram", "slack_bolt", "slack_sdk", "aiohttp.access")


# A reply is redelivered within its consumer's ack wait and retries: a week of entries is plenty.
LEDGER_KEEP_SECONDS = 7 * 24 * 3600


class ConfigError(Exception):
    """The connector cannot start: the message says which setting is wrong."""


@dataclass(frozen=True)
class BridgeSettings:
    state_path: Path | None  # the ledger of delivered replies; None keeps it in memory
    edit_interval: float  # at most one streamed edit per message per this many seconds
    retry_delay: float = 5.0  # a reply the platform refused comes again after this long

    @classmethod
    def from_env(cls, name: str, env: dict[str, str] | None = None) -> BridgeSettings:
        values = dict(os.environ if env is None else env)
        state = values.get("PARLEY_CONNECTOR_STATE")
        if state is None:
            state = str(Path(values.get("PARLEY_STATE_DIR", ".parley")) / "connectors" / f"{name}.sqlite")
        interval = values.get("PARLEY_CONNECTOR_EDIT_INTERVAL", "1.0")
        try:
            edit_interval = float(interval)
        except ValueError:
            raise ConfigError(f"PARLEY_CONNECTOR_EDIT_INTERVAL must be seconds, got {interval!r}") from None
        return cls(Path(state) if state else None, max(0.0, edit_interval))


def require(env: dict[str, str], name: str) -> str:
    value = env.get(name, "")
    if not value:
        raise ConfigError(f"{name} is not set")
    return value


class Bridge:
    """One connector: publishes what the platform receives, delivers what the agent answers."""

    def __init__(self, conn: Connector, platform: ChatPlatform, settings: BridgeSettings) -> None:
        self.conn = conn
        ledger = Ledger(settings.state_path)
        ledger.forget_older_than(LEDGER_KEEP_SECONDS)
        self.delivery = Delivery(platform, ledger, edit_interval=settings.edit_interval)
        self.settings = settings
        self.published = 0

    async def publish(self, message: Inbound) -> bool:
        """Publish an inbound message; False when it was a repeat (the agent sees it once)."""
        new = await self.conn.send(message)
        self.published += int(new)
        if not new:
            log.info("repeated message dropped by id", message_id=message.message_id)
        return new

    async def deliver_replies(self) -> None:
        async for reply in self.conn.replies(poll=1.0):
            try:
                await self.delivery.reply(reply.response_id, reply.channel_id, reply.in_reply_to, reply.text)
            except PlatformError as exc:
                log.warning(
                    "reply not delivered; retrying later", response_id=reply.response_id, reason=str(exc)
                )
                await reply.retry_later(self.settings.retry_delay)
                continue
            await reply.ack()

    async def deliver_chunks(self) -> None:
        async with self.conn.chunks() as chunks:
            async for chunk in chunks:
                try:
                    await self.delivery.chunk(
                        chunk.response_id,
                        chunk.channel_id,
                        chunk.in_reply_to,
                        chunk.sequence,
                        chunk.delta,
                        final=chunk.final,
                        outcome=chunk.outcome,
                    )
                except PlatformError as exc:  # streaming is best effort; the reply still comes
                    log.warning("stream chunk not shown", response_id=chunk.response_id, reason=str(exc))


Intake = Callable[[Bridge, asyncio.Event], Coroutine[object, object, None]]


async def serve(
    source: str,
    creds: Credentials,
    platform: ChatPlatform,
    intake: Intake,
    settings: BridgeSettings,
    stop: asyncio.Event,
) -> None:
    """Run until ``stop`` is set (or a part fails): intake, replies and chunks side by side."""
    if creds.source != source and not creds.source.startswith(f"{source}-"):
        raise ConfigError(
            f"these credentials are for source {creds.source!r}, not {source!r} (or {source}-...): "
            f"create them with `parley connectors add NAME --agent AGENT --source {source} --out FILE`"
        )
    async with await Connector.connect(creds) as conn:
        bridge = Bridge(conn, platform, settings)
        tasks = [
            asyncio.create_task(bridge.deliver_chunks(), name="chunks"),
            asyncio.create_task(bridge.deliver_replies(), name="replies"),
            asyncio.create_task(intake(bridge, stop), name="intake"),
        ]
        stopped = asyncio.create_task(stop.wait(), name="stop")
        log.info("connector running", connector=creds.name, agent_id=creds.agent_id, source=source)
        try:
            done, _ = await asyncio.wait([*tasks, stopped], return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                if task is not stopped and task.exception() is not None:
                    raise task.exception()  # type: ignore[misc]
        finally:
            stop.set()
            for task in [*tasks, stopped]:
                task.cancel()
            for task in [*tasks, stopped]:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
            await bridge.delivery.close()


def run_connector(source: str, make: Callable[[dict[str, str]], tuple[ChatPlatform, Intake]]) -> int:
    """A connector process's ``main``: exit code 0 when stopped, 2 when its configuration is wrong."""
    env = dict(os.environ)
    configure(
        f"{source}-connector",
        level=env.get("PARLEY_LOG_LEVEL", "INFO"),
        fmt=env.get("PARLEY_LOG_FORMAT", "text"),
    )
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)

    async def main() -> int:
        shutdown = ShutdownSignal()
        shutdown.install()
        try:
            creds = Credentials.from_env(env)
            settings = BridgeSettings.from_env(creds.name, env)
            platform, intake = make(env)
            await serve(source, creds, platform, intake, settings, shutdown.event)
        except (ConfigError, ParleyError) as exc:
            log.error("connector cannot run", source=source, reason=str(exc))
            return 2
        return 0

    return asyncio.run(main())
