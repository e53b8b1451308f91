"""The ``parley.v1.Mcp`` service, served over gRPC and NATS beside ``Runtime``: an agent's MCP
servers, changed through its character (so every replica reloads it), and tried once."""

from __future__ import annotations

import json
from typing import Any

from parley.v1 import mcp_pb2

from .. import errors
from ..mcp_servers import McpServerDef, check_name, parse_server_text
from .connection import McpConnection
from .registry import McpRegistry, action_name, needs_confirmation

MAX_DEFINITION_CHARS = 64_000


def _tools(server: str, connection: McpConnection | None, confirm: bool) -> list[mcp_pb2.McpTool]:
    if connection is None:
        return []
    return [
        mcp_pb2.McpTool(
            name=t.name,
            action=action_name(server, t.name),
            description=(t.description or "")[:1000],
            read_only=bool(t.annotations and t.annotations.read_only_hint),
            needs_confirmation=confirm and needs_confirmation(t),
        )
        for t in connection.tools
    ]


class McpApi:
    def __init__(self, directory: Any, registry: McpRegistry) -> None:
        self.directory = directory
        self.registry = registry

    def _message(self, agent: Any, name: str, definition: McpServerDef) -> mcp_pb2.McpServer:
        connection = self.registry.connection(agent, name)
        confirm = self.registry.settings.confirm_destructive and definition.confirm_destructive
        return mcp_pb2.McpServer(
            name=name,
            agent_id=str(agent.id),
            transport=definition.transport,
            definition_json=json.dumps(definition.public_document(), sort_keys=True),
            enabled=definition.enabled,
            state=connection.state if connection else ("stopped" if not definition.enabled else "starting"),
            error=connection.error if connection else "",
            sessions=connection.sessions if connection else 0,
            tools=_tools(name, connection, confirm),
        )

    async def _agent(self, ref: str) -> Any:
        agent = await self.directory.require(ref)
        await self.registry.refresh(agent)
        return agent

    async def ListMcpServers(self, request: mcp_pb2.ListMcpServersRequest) -> mcp_pb2.ListMcpServersResponse:
        agent = await self._agent(request.agent_id)
        servers = sorted(agent.character.mcp_servers.items())
        return mcp_pb2.ListMcpServersResponse(servers=[self._message(agent, n, d) for n, d in servers])

    async def AddMcpServer(self, request: mcp_pb2.AddMcpServerRequest) -> mcp_pb2.McpServer:
        agent = await self.directory.require(request.agent_id)
        name = check_name(request.name)
        definition = parse_server_text(name, _limited(request.definition_json))
        if definition.command is not None and not self.registry.settings.stdio_enabled:
            raise errors.MCP_STDIO_DISABLED("command: stdio MCP servers are off on this runtime")
        if definition.url is not None:
            await self.registry.guard.check(definition.url)
        servers = {**agent.character.mcp_servers, name: definition}
        saved = await self.directory.save(agent.character.model_copy(update={"mcp_servers": servers}))
        await self.registry.refresh(saved)
        return self._message(saved, name, definition)

    async def RemoveMcpServer(
        self, request: mcp_pb2.RemoveMcpServerRequest
    ) -> mcp_pb2.RemoveMcpServerResponse:
        agent = await self.directory.require(request.agent_id)
        if request.name not in agent.character.mcp_servers:
            raise errors.MCP_SERVER_NOT_FOUND(
                f"name: agent {agent.character.name!r} has no MCP server {request.name[:40]!r}"
            )
        servers = {n: d for n, d in agent.character.mcp_servers.items() if n != request.name}
        saved = await self.directory.save(agent.character.model_copy(update={"mcp_servers": servers}))
        await self.registry.refresh(saved)
        return mcp_pb2.RemoveMcpServerResponse()

    async def TestMcpServer(self, request: mcp_pb2.TestMcpServerRequest) -> mcp_pb2.TestMcpServerResponse:
        agent = await self.directory.require(request.agent_id)
        name = check_name(request.name or "test")
        if request.definition_json.strip():
            definition = parse_server_text(name, _limited(request.definition_json))
        elif request.name in agent.character.mcp_servers:
            definition = agent.character.mcp_servers[request.name]
        else:
            raise errors.MCP_SERVER_NOT_FOUND(
                f"name: agent {agent.character.name!r} has no MCP server {request.name[:40]!r} "
                "(or give definition_json)"
            )
        settings = self.registry.settings
        connection = McpConnection(
            agent.character.name,
            name,
            definition,
            guard=self.registry.guard,
            stdio_enabled=settings.stdio_enabled,
            setting=agent.setting,
            redact=agent.redactor.redact,
            call_timeout=settings.call_timeout,
        )
        try:
            await connection.start()
            ok = connection.session is not None
            confirm = settings.confirm_destructive and definition.confirm_destructive
            return mcp_pb2.TestMcpServerResponse(
                ok=ok, error="" if ok else connection.error, tools=_tools(name, connection, confirm)
            )
        finally:
            await connection.stop()


def _limited(text: str) -> str:
    if len(text) > MAX_DEFINITION_CHARS:
        raise errors.MCP_SERVER_INVALID("definition_json is over 64 kB")
    if not text.strip():
        raise errors.MCP_SERVER_INVALID('definition_json is required: {"command": ...} or {"url": ...}')
    return text
