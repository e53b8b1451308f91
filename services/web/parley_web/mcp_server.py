"""Agents served as MCP tools: streamable HTTP at ``/mcp`` (the official ``mcp`` SDK's server),
with the API keys of the OpenAI-compatible endpoint.

A key reaches one agent, served as the tool ``ask_<agent name in lower snake case>`` taking
``message`` and an optional ``conversation_id``. A conversation id names a room (channel
``<connector>:mcp:<conversation id>``), so a client holds a conversation through tool calls; a call
without one starts a new conversation, whose id comes back in the structured content with the turn
id. While the reply streams, each chunk is a progress notification (when the call asked for them).
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import uuid
from typing import Any

import mcp_types as types
from mcp.server.lowlevel import Server
from mcp.server.streamable_http_manager import StreamableHTTPSessionManager
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.types import Receive, Scope, Send

from parley_connectors import Inbound
from parley_platform import permissions
from parley_platform.errors import ParleyError
from parley_platform.logging import get_logger

from . import errors
from .access import Access, Caller, room_id
from .relay import Delta, Relay

log = get_logger(__name__)

MAX_CONVERSATION_ID = 128
CONVERSATION_RE = re.compile(r"^[A-Za-z0-9_.:-]{1,128}$")


def tool_name(agent_name: str) -> str:
    """``ask_`` and the agent's name in lower snake case: ``Support Bot`` → ``ask_support_bot``."""
    snake = re.sub(r"[^a-z0-9]+", "_", agent_name.lower()).strip("_")
    return f"ask_{snake or 'agent'}"


def turn_id(agent_id: str, message_id: str) -> str:
    """The runtime's turn id of a message (parley_runtime.ids.message_id): the message memory's id."""
    return str(uuid.uuid5(uuid.UUID(agent_id), f"{permissions.WEB_SOURCE}:message:{message_id}"))


def _failure(text: str) -> types.CallToolResult:
    return types.CallToolResult(content=[types.TextContent(text=text)], is_error=True)


class McpEndpoint:
    """The ``/mcp`` ASGI app: the key is checked before the SDK sees the request."""

    def __init__(self, access: Access, relay: Relay, *, reply_timeout: float, max_chars: int) -> None:
        self.access = access
        self.relay = relay
        self.reply_timeout = reply_timeout
        self.max_chars = max_chars
        self.server: Server[Any] = Server(
            "parley", version="1", on_list_tools=self.list_tools, on_call_tool=self.call_tool
        )
        self.manager = StreamableHTTPSessionManager(app=self.server, stateless=True)
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """The SDK's session manager runs in a task of its own (its task group is entered and left
        there) until ``stop``."""
        ready = asyncio.Event()

        async def run() -> None:
            async with self.manager.run():
                ready.set()
                await self._stop.wait()

        self._task = asyncio.create_task(run(), name="mcp sessions")
        waiting = asyncio.ensure_future(ready.wait())
        await asyncio.wait({waiting, self._task}, return_when=asyncio.FIRST_COMPLETED)
        waiting.cancel()
        if self._task.done():
            self._task.result()

    async def stop(self, timeout: float) -> None:
        self._stop.set()
        if self._task is not None:
            with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
                await asyncio.wait_for(self._task, timeout)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            request = Request(scope)
            try:
                await self.access.caller(request.headers.get("authorization", ""))
            except ParleyError as exc:
                status = 401 if exc.code == "INVALID_API_KEY" else 503
                body = {"error": {"code": exc.code, "message": exc.message}}
                await JSONResponse(body, status_code=status)(scope, receive, send)
                return
        await self.manager.handle_request(scope, receive, send)

    async def _caller(self, ctx: Any) -> Caller:
        request = ctx.request
        if not isinstance(request, Request):
            raise errors.INVALID_API_KEY("no API key: send Authorization: Bearer <api_key>")
        return await self.access.caller(request.headers.get("authorization", ""))

    async def list_tools(
        self, ctx: Any, params: types.PaginatedRequestParams | None
    ) -> types.ListToolsResult:
        caller = await self._caller(ctx)
        name = await self.access.agent_name(caller.agent_id)
        tool = types.Tool(
            name=tool_name(name),
            description=f"Ask the agent {name} and get its reply. Pass the conversation_id of an "
            "earlier answer to go on with that conversation.",
            input_schema={
                "type": "object",
                "properties": {
                    "message": {"type": "string", "description": "what to say to the agent"},
                    "conversation_id": {
                        "type": "string",
                        "description": "an earlier answer's conversation_id, to continue it",
                    },
                },
                "required": ["message"],
            },
            output_schema={
                "type": "object",
                "properties": {
                    "reply": {"type": "string"},
                    "turn_id": {"type": "string"},
                    "conversation_id": {"type": "string"},
                    "room_id": {"type": "string"},
                },
                "required": ["reply", "turn_id", "conversation_id", "room_id"],
            },
            annotations=types.ToolAnnotations(read_only_hint=False, open_world_hint=True),
        )
        return types.ListToolsResult(tools=[tool])

    async def call_tool(self, ctx: Any, params: types.CallToolRequestParams) -> types.CallToolResult:
        caller = await self._caller(ctx)
        name = await self.access.agent_name(caller.agent_id)
        if params.name != tool_name(name):
            return _failure(f"unknown tool {params.name[:100]!r}: this key reaches {tool_name(name)}")
        args = params.arguments or {}
        message, conversation = args.get("message"), args.get("conversation_id") or uuid.uuid4().hex
        if not isinstance(message, str) or not message.strip():
            return _failure("message is required: a non-empty string")
        if len(message) > self.max_chars:
            return _failure(f"message is longer than {self.max_chars} characters")
        if not isinstance(conversation, str) or not CONVERSATION_RE.match(conversation):
            return _failure("conversation_id must be 1-128 letters, digits, '_', '.', ':' or '-'")
        channel = f"{caller.connector}:mcp:{conversation}"
        inbound = Inbound(
            agent_id=caller.agent_id,
            message_id=uuid.uuid4().hex,
            sender_id=f"{caller.connector}:mcp",
            sender_name=caller.connector,
            channel_id=channel,
            room_type="dm",
            text=message,
            metadata={"connector": caller.connector, "via": "mcp"},
        )
        text, outcome = "", "completed"
        async with self.relay.waiting(caller.agent_id, inbound.message_id) as waiter:
            await self.relay.send(inbound)
            try:
                async for event in waiter.events(self.reply_timeout):
                    if isinstance(event, Delta):
                        # A no-op unless the call asked for progress.
                        text += event.text
                        await ctx.session.report_progress(float(len(text)), None, event.text)
                    else:
                        text, outcome = event.text, event.outcome
            except TimeoutError:
                with contextlib.suppress(ParleyError):
                    await self.relay.cancel(caller.agent_id, inbound.message_id, "timeout")
                return _failure(f"no reply within {self.reply_timeout:g} s")
        if outcome != "completed":
            return _failure(f"the agent's turn ended without a reply: {outcome}")
        structured = {
            "reply": text,
            "turn_id": turn_id(caller.agent_id, inbound.message_id),
            "conversation_id": conversation,
            "room_id": room_id(caller.agent_id, channel),
        }
        return types.CallToolResult(content=[types.TextContent(text=text)], structured_content=structured)
