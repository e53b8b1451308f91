"""One MCP session per server per replica, with the official ``mcp`` SDK's client: a plugin service
whose task opens the transport (a stdio child process, or streamable HTTP to a URL the SSRF guard
checked), initializes, lists the tools, then pings the server every ``PING_SECONDS``. When the
session ends (the process died, the server went away, a ping failed), it is opened again after a
backoff (0.2 s doubling to 30 s, back to 0.2 s after a session that lasted a minute). Calls wait
for the session while it is being opened again, up to their deadline.

``notifications/tools/list_changed`` lists the tools again; each new list bumps ``version``, which
the registry compares before each turn."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx2
import mcp_types as types
from mcp import ClientSession, MCPError, StdioServerParameters, stdio_client
from mcp.client.session import IncomingMessage
from mcp.client.streamable_http import streamable_http_client
from mcp.shared._httpx_utils import create_mcp_http_client

from parley_platform.errors import ParleyError
from parley_platform.logging import get_logger

from .. import errors
from ..custom.ssrf import Guard
from ..mcp_servers import McpServerDef
from ..sdk import ServiceRun

log = get_logger(__name__)
# The SDK's HTTP client logs every request (a ping every PING_SECONDS) at INFO.
logging.getLogger("httpx2").setLevel(logging.WARNING)

PING_SECONDS = 2.0
FIRST_BACKOFF, MAX_BACKOFF, STEADY_SECONDS = 0.2, 30.0, 60.0
START_WAIT_SECONDS, START_ATTEMPTS = 15.0, 3


class McpConnection:
    def __init__(
        self,
        agent: str,
        server: str,
        definition: McpServerDef,
        *,
        guard: Guard,
        stdio_enabled: bool,
        setting: Callable[[str], object | None],
        redact: Callable[[str], str],
        call_timeout: float = 30.0,
    ) -> None:
        self.name = f"mcp:{agent}:{server}"
        self.server = server
        self.definition = definition
        self.guard = guard
        self.stdio_enabled = stdio_enabled
        self.setting = setting
        self.redact = redact
        self.call_timeout = call_timeout
        self.tools: list[types.Tool] = []
        self.version = 0
        self.state = "stopped"
        self.error = ""
        self.sessions = 0  # sessions opened so far: 2 or more means it was restarted
        self.session: ClientSession | None = None
        self._connected = asyncio.Event()
        self.attempts = 0  # sessions that ended (or never opened)
        self.refused = False
        self._changed = asyncio.Event()  # connected, or an attempt ended
        self._stopping = asyncio.Event()
        self._broken = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._relists: set[asyncio.Task[None]] = set()

    # --- the plugin service -----------------------------------------------------------------------

    async def start(self, run: ServiceRun | None = None) -> None:
        """Opens the first session; waits (a bounded time, and at most ``START_ATTEMPTS`` tries)
        for its tool list, so an agent's first turn after the server is attached can use them. A
        server that cannot be reached is retried in the background, its error kept for
        ``parley mcp list``."""
        if self._task is not None:
            return
        self.state = "starting"
        self._task = asyncio.create_task(self._run(), name=self.name)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + START_WAIT_SECONDS
        while not self._connected.is_set() and self.attempts < START_ATTEMPTS and not self.refused:
            self._changed.clear()
            remaining = deadline - loop.time()
            if remaining <= 0:
                break
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), remaining)

    async def stop(self) -> None:
        self._stopping.set()
        self._broken.set()
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self.state = "stopped"

    async def health(self) -> bool:
        return self.session is not None

    # --- calls ------------------------------------------------------------------------------------

    async def call(self, tool: str, arguments: dict[str, Any]) -> types.CallToolResult:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.call_timeout
        try:
            await asyncio.wait_for(self._connected.wait(), self.call_timeout)
        except TimeoutError:
            raise errors.MCP_UNAVAILABLE(
                f"MCP server {self.server} is not connected: {self.error or self.state}"
            ) from None
        session = self.session
        if session is None:
            raise errors.MCP_UNAVAILABLE(f"MCP server {self.server} is not connected: {self.state}")
        try:
            result = await session.call_tool(
                tool, arguments, read_timeout_seconds=max(0.1, deadline - loop.time())
            )
        except Exception as exc:
            if not isinstance(exc, MCPError | TimeoutError):
                self._broken.set()  # not the server's answer: the session is suspect, open it again
            raise errors.MCP_UNAVAILABLE(
                f"MCP server {self.server}: {self.redact(f'{type(exc).__name__}: {exc}')[:500]}"
            ) from None
        if self._relists:
            # The tool announced a changed tool list while it ran: the next turn sees the new one.
            await asyncio.wait(set(self._relists), timeout=max(0.1, deadline - loop.time()))
        if not isinstance(result, types.CallToolResult):
            raise errors.MCP_UNAVAILABLE(f"MCP server {self.server} asked for input, which is not supported")
        return result

    # --- the session ------------------------------------------------------------------------------

    async def _run(self) -> None:
        backoff = FIRST_BACKOFF
        while not self._stopping.is_set():
            opened = time.monotonic()
            try:
                await self._session()
            except asyncio.CancelledError:
                raise
            except BaseException as exc:  # the SDK's task groups raise exception groups
                # Refused by this side (the guard, stdio off, a missing secret): not worth waiting for.
                self.refused = isinstance(exc, ParleyError)
                self.error = self.redact(_describe(exc))[:500]
                log.warning("MCP session ended", service=self.name, error=self.error)
            finally:
                self.session = None
                self._connected.clear()
                self.attempts += 1
                self._changed.set()
            if self._stopping.is_set():
                return
            self.state = "restarting"
            if time.monotonic() - opened > STEADY_SECONDS:
                backoff = FIRST_BACKOFF
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), backoff)
            backoff = min(backoff * 2, MAX_BACKOFF)

    async def _session(self) -> None:
        self._broken.clear()
        async with (
            self._transport() as (read, write),
            ClientSession(read, write, message_handler=self._on_message) as session,
        ):
            await session.initialize()
            await self._list(session)
            self.sessions += 1
            self.session, self.state, self.error = session, "connected", ""
            self._connected.set()
            self._changed.set()
            log.info("MCP session open", service=self.name, tools=len(self.tools), sessions=self.sessions)
            while not self._broken.is_set():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._broken.wait(), PING_SECONDS)
                if not self._broken.is_set():
                    await session.send_ping()  # raises when the server is gone
            raise ConnectionError("the session was found broken")

    @contextlib.asynccontextmanager
    async def _transport(self) -> AsyncIterator[tuple[Any, Any]]:
        d = self.definition
        if d.command is not None:
            if not self.stdio_enabled:
                raise errors.MCP_STDIO_DISABLED("stdio MCP servers are off on this runtime")
            params = StdioServerParameters(
                command=d.command, args=list(d.args), env=d.resolve(d.env, self.setting) or None
            )
            # The server's stderr is kept (its end joins the error when the session ends).
            with tempfile.TemporaryFile("w+", encoding="utf-8", errors="replace") as errlog:
                try:
                    async with stdio_client(params, errlog=errlog) as streams:
                        yield streams[0], streams[1]
                except BaseException as exc:
                    errlog.seek(0)
                    said = errlog.read()[-300:].strip()
                    if said and not isinstance(exc, asyncio.CancelledError):
                        raise ConnectionError(f"{_describe(exc)}; the server said: {said}") from exc
                    raise
            return
        assert d.url is not None
        target = await self.guard.check(d.url)
        headers = d.resolve(d.headers, self.setting)
        url = d.url
        if d.url.startswith("http://"):
            # Pinned to the checked address: a DNS answer that changes later cannot redirect it.
            url, headers = target.url, {**headers, "Host": target.host_header}
        http: httpx2.AsyncClient = create_mcp_http_client(headers=headers)
        async with http, streamable_http_client(url, http_client=http) as streams:
            yield streams[0], streams[1]

    async def _list(self, session: ClientSession) -> None:
        tools: list[types.Tool] = []
        cursor: str | None = None
        while True:
            page = await session.list_tools(
                params=types.PaginatedRequestParams(cursor=cursor) if cursor else None
            )
            tools.extend(page.tools)
            cursor = page.next_cursor
            if not cursor or len(tools) > 1000:
                break
        self.tools = tools
        self.version += 1

    async def _on_message(self, message: IncomingMessage) -> None:
        if isinstance(message, Exception):
            log.info("MCP transport error", service=self.name, error=self.redact(_describe(message))[:300])
            return
        if isinstance(message, types.ToolListChangedNotification):
            task = asyncio.create_task(self._relist(), name=f"{self.name} relist")
            self._relists.add(task)
            task.add_done_callback(self._relists.discard)

    async def _relist(self) -> None:
        session = self.session
        if session is None:
            return
        try:
            await self._list(session)
            log.info("MCP tools changed", service=self.name, tools=len(self.tools))
        except Exception as exc:
            log.warning("MCP tools not listed again", service=self.name, error=self.redact(_describe(exc)))
            self._broken.set()


def _describe(exc: BaseException) -> str:
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    message = getattr(exc, "message", None) or str(exc)
    return f"{type(exc).__name__}: {message}" if message else type(exc).__name__
