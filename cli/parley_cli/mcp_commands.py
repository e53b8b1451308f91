"""`parley mcp list|add|remove|test AGENT`: an agent's MCP servers, whose tools are its actions."""

from __future__ import annotations

import json as jsonlib
import sys
from typing import Annotated

import typer

from parley.v1 import mcp_pb2, mcp_pb2_grpc
from parley_platform.errors import InvalidArgument

from . import client, common
from .common import Json, command

app = common.group("mcp", "An agent's MCP servers: their tools are its actions (docs/mcp.md).")
call = client.caller("runtime", mcp_pb2_grpc.McpStub)  # the runtime serves them

AgentArg = Annotated[str, typer.Argument(metavar="AGENT", help="agent name or id")]
Name = Annotated[str, typer.Argument(metavar="NAME", help="the server's name (its tools: NAME_<TOOL>)")]


def _definition(
    command_line: list[str] | None, url: str, headers: list[str] | None, env: list[str] | None, raw: str
) -> str:
    """The definition as JSON: given whole (--json-definition), or from the options."""
    if raw:
        return raw
    if bool(command_line) == bool(url):
        raise InvalidArgument(
            "give either --url URL or a command after -- (e.g. -- mcp-server-time)", code="MCP_SERVER_INVALID"
        )

    def pairs(values: list[str] | None, what: str) -> dict[str, str]:
        found = {}
        for value in values or []:
            key, sep, rest = value.partition("=" if what == "env" else ":")
            if not sep or not key.strip():
                raise InvalidArgument(
                    f"--{what} takes NAME{'=' if what == 'env' else ':'}VALUE", code="MCP_SERVER_INVALID"
                )
            found[key.strip()] = rest.strip()
        return found

    if url:
        return jsonlib.dumps({"url": url, "headers": pairs(headers, "header")})
    assert command_line
    return jsonlib.dumps({"command": command_line[0], "args": command_line[1:], "env": pairs(env, "env")})


@command(app, "list")
async def list_servers(agent: AgentArg, json: Json = False) -> None:
    """The agent's MCP servers, with the answering replica's session state and tools."""
    reply = await call("ListMcpServers", mcp_pb2.ListMcpServersRequest(agent_id=agent))
    if json:
        common.print_json([common.as_dict(s) for s in reply.servers])
        return
    common.table(
        ["NAME", "TRANSPORT", "STATE", "SESSIONS", "TOOLS", "ERROR"],
        [
            [s.name, s.transport, s.state, s.sessions, " ".join(t.action for t in s.tools), s.error]
            for s in reply.servers
        ],
    )


@command(app)
async def add(
    agent: AgentArg,
    name: Name,
    command_line: Annotated[
        list[str] | None, typer.Argument(metavar="[-- COMMAND ARGS...]", help="a stdio server's command")
    ] = None,
    url: str = typer.Option("", help="a streamable HTTP server's URL"),
    header: list[str] | None = typer.Option(
        None, metavar="NAME:VALUE", help="an HTTP header; VALUE may be {{secret:NAME}}"
    ),
    env: list[str] | None = typer.Option(None, metavar="NAME=VALUE", help="a stdio server's environment"),
    definition: str = typer.Option("", "--definition", metavar="JSON", help="the whole definition as JSON"),
) -> None:
    """Add (or replace) an MCP server of the agent; every replica uses its tools from its next turn."""
    request = mcp_pb2.AddMcpServerRequest(
        agent_id=agent, name=name, definition_json=_definition(command_line, url, header, env, definition)
    )
    server = await call("AddMcpServer", request, timeout=60.0)
    tools = ", ".join(t.action for t in server.tools) or "none yet"
    print(f"added {server.name} ({server.transport}, {server.state}); actions: {tools}")
    if server.error:
        print(f"its last session ended: {server.error}", file=sys.stderr)


@command(app)
async def remove(agent: AgentArg, name: Name) -> None:
    """Remove an MCP server of the agent (its session is closed, its actions go)."""
    await call("RemoveMcpServer", mcp_pb2.RemoveMcpServerRequest(agent_id=agent, name=name))
    print(f"removed {name}")


@command(app, "test")
async def try_server(
    agent: AgentArg,
    name: Name,
    definition: str = typer.Option("", "--definition", metavar="JSON", help="try this definition instead"),
    json: Json = False,
) -> int:
    """Open a session to the server, list its tools, close it. Exit code 1 when it fails."""
    request = mcp_pb2.TestMcpServerRequest(agent_id=agent, name=name, definition_json=definition)
    reply = await call("TestMcpServer", request, timeout=90.0)
    if json:
        common.print_json(common.as_dict(reply))
    elif reply.ok:
        common.table(
            ["ACTION", "TOOL", "READ-ONLY", "CONFIRM", "DESCRIPTION"],
            [[t.action, t.name, t.read_only, t.needs_confirmation, t.description[:60]] for t in reply.tools],
        )
    else:
        print(f"failed: {reply.error}")
    return 0 if reply.ok else 1
