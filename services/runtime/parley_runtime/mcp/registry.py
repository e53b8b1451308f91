"""Each agent's MCP servers as its ``mcp`` plugin: one ``McpConnection`` per server (a plugin
service of that plugin, started through ``PluginServices``), and one action per tool, named
``<SERVER>_<TOOL>`` in upper snake case, with the tool's input schema as its parameters and its
description for the planner.

Before each turn (and each confirmed call) the agent's plugin is rebuilt when its servers or a
server's tool list changed. ``readOnlyHint`` tools are idempotent (a retried turn may run them
again); ``destructiveHint`` tools (the MCP default for a tool that is not read-only) carry the
``confirm`` tag, so a person approves each call through authz, unless the server's definition
or the runtime (``PARLEY_MCP_CONFIRM_DESTRUCTIVE=false``) says otherwise."""

from __future__ import annotations

import json
import re
import uuid
import weakref
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import mcp_types as types

from parley_platform.consumer import Delivery
from parley_platform.logging import get_logger

from ..custom.ssrf import Guard
from ..mcp_servers import McpServerDef
from ..plugins.catalog import Catalog
from ..sdk import Action, ActionResult, Callback, Content, Parameter, Plugin, Tag, TurnContext
from .connection import McpConnection

log = get_logger(__name__)

PLUGIN_NAME = "mcp"
MAX_RESULT_CHARS = 16_000


@dataclass(frozen=True)
class McpSettings:
    stdio_enabled: bool = False
    confirm_destructive: bool = True
    allow_hosts: tuple[str, ...] = ()
    call_timeout: float = 30.0


def action_name(server: str, tool: str) -> str:
    name = re.sub(r"[^A-Za-z0-9]+", "_", f"{server}_{tool}").strip("_").upper()
    return name[:64] if name[:1].isalpha() else f"MCP_{name}"[:64]


def needs_confirmation(tool: types.Tool) -> bool:
    hints = tool.annotations
    if hints is not None and hints.read_only_hint:
        return False
    # The spec's default for a tool that may write is destructive.
    return hints is None or hints.destructive_hint is not False


def result_text(result: types.CallToolResult) -> str:
    parts = []
    for block in result.content:
        if isinstance(block, types.TextContent):
            parts.append(block.text)
        elif isinstance(block, types.EmbeddedResource) and isinstance(
            block.resource, types.TextResourceContents
        ):
            parts.append(block.resource.text)
        else:
            parts.append(f"[{block.type}]")
    if not parts and result.structured_content is not None:
        parts.append(json.dumps(result.structured_content, sort_keys=True))
    return "\n".join(parts)[:MAX_RESULT_CHARS]


def to_action(server: str, tool: types.Tool, connection: McpConnection, confirm_destructive: bool) -> Action:
    name = action_name(server, tool.name)
    data_base = {"mcpServer": server, "tool": tool.name}
    schema = tool.input_schema or {}
    properties = schema.get("properties") or {}
    required = set(schema.get("required") or ())

    async def handler(ctx: TurnContext, params: dict[str, Any], callback: Callback) -> ActionResult:
        try:
            result = await connection.call(tool.name, params)
        except Exception as exc:
            text = getattr(exc, "message", None) or f"{type(exc).__name__}: {exc}"
            return ActionResult(False, text=text, data=data_base, error=text)
        text = result_text(result)
        data = dict(data_base)
        if result.structured_content is not None:
            data["structuredContent"] = result.structured_content
        if result.is_error:
            return ActionResult(False, text=text, data=data, error=text or "the tool failed")
        if text.strip():
            await callback(Content(text=text, actions=(name,)))
        return ActionResult(True, text=text, data=data)

    tags = set()
    if tool.annotations is not None and tool.annotations.read_only_hint:
        tags.add(Tag.IDEMPOTENT)
    if confirm_destructive and needs_confirmation(tool):
        tags.add(Tag.CONFIRM)
    return Action(
        name=name,
        description=(tool.description or tool.title or f"the {tool.name} tool of {server}")[:1000],
        handler=handler,
        parameters=tuple(
            Parameter(
                key,
                str(spec.get("description", "")) if isinstance(spec, dict) else "",
                key in required,
                dict(spec) if isinstance(spec, dict) else {},
            )
            for key, spec in properties.items()
        ),
        tags=frozenset(tags),
        capabilities=frozenset({"mcp"}),
    )


class McpRegistry:
    """The MCP servers of the agents on this replica."""

    def __init__(
        self,
        directory: Any,
        settings: McpSettings,
        start_services: Callable[[Any], Awaitable[None]],
    ) -> None:
        self.directory = directory
        self.settings = settings
        self.guard = Guard(settings.allow_hosts)
        self.start_services = start_services
        self.connections: dict[tuple[uuid.UUID, str], tuple[str, McpConnection]] = {}
        self._applied: dict[uuid.UUID, tuple[weakref.ref[Any], tuple[tuple[str, int], ...]]] = {}

    def before_turns(
        self, handle: Callable[[Delivery], Awaitable[None]], agent_token: int = 2
    ) -> Callable[[Delivery], Awaitable[None]]:
        """``handle`` preceded by bringing the delivery's agent's MCP plugin up to date."""

        async def checked(delivery: Delivery) -> None:
            tokens = delivery.subject.split(".")
            try:
                agent_id: uuid.UUID | None = uuid.UUID(tokens[agent_token])
            except (ValueError, IndexError):
                agent_id = None
            if agent_id is not None:
                agent = self.directory.agents.get(str(agent_id))
                if agent is not None:
                    await self.refresh(agent)
            await handle(delivery)

        return checked

    def servers(self, agent: Any) -> dict[str, McpServerDef]:
        return dict(agent.character.mcp_servers)

    def connection(self, agent: Any, server: str) -> McpConnection | None:
        found = self.connections.get((agent.id, server))
        return found[1] if found else None

    async def refresh(self, agent: Any) -> None:
        wanted = {n: d for n, d in self.servers(agent).items() if d.enabled}
        started = False
        for (agent_id, name), (digest, connection) in list(self.connections.items()):
            if agent_id == agent.id and (name not in wanted or wanted[name].digest() != digest):
                del self.connections[(agent_id, name)]
                await connection.stop()
        for name, definition in wanted.items():
            if (agent.id, name) not in self.connections:
                connection = McpConnection(
                    agent.character.name,
                    name,
                    definition,
                    guard=self.guard,
                    stdio_enabled=self.settings.stdio_enabled,
                    setting=agent.setting,
                    redact=agent.redactor.redact,
                    call_timeout=self.settings.call_timeout,
                )
                self.connections[(agent.id, name)] = (definition.digest(), connection)
                started = True
        versions = tuple(
            sorted((n, c.version) for (a, n), (_, c) in self.connections.items() if a == agent.id)
        )
        applied = self._applied.get(agent.id)
        if applied is None or applied[0]() is not agent or applied[1] != versions or started:
            self.apply(agent)
            if started:
                await self.start_services(agent)  # starts the new connections: their tools come
                self.apply(agent)

    def apply(self, agent: Any) -> None:
        base = [p for p in agent.catalog.plugins if p.name != PLUGIN_NAME]
        taken = {a.name for p in base for a in p.actions}
        actions: list[Action] = []
        services = []
        for (agent_id, server), (_, connection) in sorted(self.connections.items(), key=lambda i: i[0][1]):
            if agent_id != agent.id:
                continue
            services.append(connection)
            confirm = self.settings.confirm_destructive and connection.definition.confirm_destructive
            for tool in connection.tools:
                action = to_action(server, tool, connection, confirm)
                if action.name in taken:
                    log.warning(
                        "MCP tool shadows an action; left out", agent_id=str(agent.id), action=action.name
                    )
                    continue
                taken.add(action.name)
                actions.append(action)
        plugin = Plugin(PLUGIN_NAME, "tools of MCP servers", actions=tuple(actions), services=tuple(services))
        agent.catalog = Catalog([*base, plugin])
        versions = tuple(
            sorted((n, c.version) for (a, n), (_, c) in self.connections.items() if a == agent.id)
        )
        self._applied[agent.id] = (weakref.ref(agent), versions)

    async def start(self) -> None:
        for agent in list(self.directory.agents.values()):
            await self.refresh(agent)
        self.directory.on_loaded(self.refresh)

    async def stop(self, timeout: float) -> None:
        connections, self.connections = list(self.connections.values()), {}
        for _, connection in connections:
            await connection.stop()
