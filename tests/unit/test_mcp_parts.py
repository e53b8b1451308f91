"""MCP's pure parts: server definitions (the mcpServers shape, secrets, masking), action names,
annotations to tags, results to text, and the web side's tool names and turn ids."""

from __future__ import annotations

import uuid

import mcp_types as types
import pytest

from parley_platform.errors import InvalidArgument, ParleyError
from parley_runtime import ids
from parley_runtime.character import parse_character
from parley_runtime.custom.ssrf import Guard
from parley_runtime.mcp.connection import McpConnection
from parley_runtime.mcp.registry import action_name, needs_confirmation, result_text, to_action
from parley_runtime.mcp_servers import McpServerDef, parse_server, parse_server_text
from parley_runtime.sdk import Tag
from parley_web.mcp_server import tool_name, turn_id


def test_the_common_shapes_parse() -> None:
    stdio = parse_server("time", {"command": "mcp-server-time", "args": ["--local-timezone", "UTC"]})
    http = parse_server("notes", {"url": "https://notes.example.com/mcp", "headers": {"X": "y"}})
    assert (stdio.transport, http.transport) == ("stdio", "http")
    assert stdio.digest() != http.digest()


@pytest.mark.parametrize(
    ("name", "data", "says"),
    [
        ("t", {"command": "x", "url": "https://a.example/"}, "either command"),
        ("t", {}, "either command"),
        ("t", {"url": "ftp://a.example/"}, "http(s) URL"),
        ("t", {"url": "https://user:pw@a.example/"}, "must not hold credentials"),
        ("t", {"url": "https://a.example/", "env": {"A": "b"}}, "for stdio servers"),
        ("t", {"command": "x", "headers": {"A": "b"}}, "for streamable HTTP"),
        ("t", {"command": "x", "colour": "red"}, "colour"),
        ("1bad", {"command": "x"}, "a letter"),
    ],
)
def test_bad_definitions_say_what_is_wrong(name: str, data: dict[str, object], says: str) -> None:
    with pytest.raises(InvalidArgument) as caught:
        parse_server(name, data)
    assert caught.value.code == "MCP_SERVER_INVALID"
    assert says in caught.value.message
    assert "pw@" not in caught.value.message


def test_definition_json_must_be_json() -> None:
    with pytest.raises(InvalidArgument, match="not valid JSON"):
        parse_server_text("t", "{nope")


def test_secrets_are_resolved_and_never_listed() -> None:
    d = McpServerDef(
        url="https://a.example/mcp",
        headers={"Authorization": "Bearer {{secret:TOKEN}}", "X-Api-Key": "literal", "X-Plain": "v"},
    )
    assert d.resolve(d.headers, {"TOKEN": "s3cret"}.get)["Authorization"] == "Bearer s3cret"
    shown = d.public_document()["headers"]
    assert shown == {"Authorization": "***", "X-Api-Key": "***", "X-Plain": "v"}
    placeholder = McpServerDef(url="https://a.example/mcp", headers={"Authorization": "{{secret:TOKEN}}"})
    assert placeholder.public_document()["headers"] == {"Authorization": "{{secret:TOKEN}}"}
    with pytest.raises(ParleyError) as caught:
        d.resolve(d.headers, {}.get)
    assert caught.value.code == "MCP_SECRET_MISSING"
    assert "TOKEN" in caught.value.message


def test_a_character_names_its_servers() -> None:
    character = parse_character({"name": "a", "mcpServers": {"time": {"command": "mcp-server-time"}}})
    assert character.mcp_servers["time"].command == "mcp-server-time"
    assert "mcpServers" in character.document()
    with pytest.raises(InvalidArgument, match="mcpServers"):
        parse_character({"name": "a", "mcpServers": {"bad name": {"command": "x"}}})


def test_action_names_are_upper_snake() -> None:
    assert action_name("time", "get_current_time") == "TIME_GET_CURRENT_TIME"
    assert action_name("my-notes", "erase.all") == "MY_NOTES_ERASE_ALL"
    assert len(action_name("s", "x" * 200)) == 64


def _tool(annotations: types.ToolAnnotations | None) -> types.Tool:
    schema = {
        "type": "object",
        "properties": {"q": {"type": "string", "description": "what"}},
        "required": ["q"],
    }
    return types.Tool(name="t", description="does t", input_schema=schema, annotations=annotations)


def test_annotations_become_tags() -> None:
    connection = McpConnection(
        "a", "s", McpServerDef(command="x"), guard=Guard(), stdio_enabled=False, setting={}.get, redact=str
    )
    read_only = to_action("s", _tool(types.ToolAnnotations(read_only_hint=True)), connection, True)
    destructive = to_action("s", _tool(types.ToolAnnotations(destructive_hint=True)), connection, True)
    unhinted = to_action("s", _tool(None), connection, True)
    additive = to_action(
        "s", _tool(types.ToolAnnotations(read_only_hint=False, destructive_hint=False)), connection, True
    )
    operator_off = to_action("s", _tool(types.ToolAnnotations(destructive_hint=True)), connection, False)
    assert read_only.tags == {Tag.IDEMPOTENT}
    assert destructive.tags == {Tag.CONFIRM}
    assert unhinted.tags == {Tag.CONFIRM}
    assert additive.tags == frozenset()
    assert operator_off.tags == frozenset()
    assert not needs_confirmation(_tool(types.ToolAnnotations(read_only_hint=True)))
    [param] = read_only.parameters
    assert (param.name, param.required, param.description) == ("q", True, "what")
    assert read_only.description == "does t"


def test_results_become_text() -> None:
    result = types.CallToolResult(content=[types.TextContent(text="a"), types.TextContent(text="b")])
    assert result_text(result) == "a\nb"
    structured = types.CallToolResult(content=[], structured_content={"x": 1})
    assert result_text(structured) == '{"x": 1}'


def test_web_tool_names_and_turn_ids() -> None:
    assert tool_name("default") == "ask_default"
    assert tool_name("Support Bot") == "ask_support_bot"
    assert tool_name("a.b-c") == "ask_a_b_c"
    agent = uuid.uuid4()
    assert turn_id(str(agent), "m1") == str(ids.message_id(agent, "web", "m1"))
