"""Agents served over MCP: the official `mcp` client against the web connector's ``/mcp`` (gateway,
runtime, pairing and web as processes, real NATS and Postgres): the key's agent listed as
``ask_default``, called, a conversation kept through ``conversation_id``, progress while the reply
streams, a wrong key refused."""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest
from mcp import ClientSession
from mcp.client.streamable_http import streamable_http_client
from mcp.shared._httpx_utils import create_mcp_http_client

from parley.v1 import runtime_pb2
from parley.v1.runtime_nats import RuntimeClient
from parley_platform.errors import ParleyError
from parley_platform.rpc import RpcClient
from parley_platform.testing import eventually
from support import DEFAULT_AGENT_ID, SessionEnv
from web_support import Web, web_fixture


@pytest.fixture(scope="module")
async def web(test_env: SessionEnv, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Web]:
    async for running in web_fixture(test_env, tmp_path_factory):
        yield running


@asynccontextmanager
async def session(web: Web, key: str | None = None) -> AsyncIterator[ClientSession]:
    http = create_mcp_http_client(headers={"Authorization": f"Bearer {key or web.key}"})
    async with (
        http,
        streamable_http_client(f"{web.url}/mcp", http_client=http) as (read, write),
        ClientSession(read, write) as client,
    ):
        await client.initialize()
        yield client


async def test_the_keys_agent_is_listed_as_a_tool(web: Web) -> None:
    async with session(web) as client:
        tools = (await client.list_tools()).tools
    assert [t.name for t in tools] == ["ask_default"]
    [tool] = tools
    assert tool.input_schema["required"] == ["message"]
    assert set(tool.input_schema["properties"]) == {"message", "conversation_id"}


async def test_a_call_is_answered_with_the_agents_reply_and_progress(web: Web) -> None:
    progress: list[tuple[float, str | None]] = []

    async def on_progress(value: float, total: float | None, message: str | None) -> None:
        progress.append((value, message))

    async with session(web) as client:
        result: Any = await client.call_tool(
            "ask_default", {"message": "tell me a story"}, progress_callback=on_progress
        )
    assert not result.is_error
    text = result.content[0].text
    assert "tell me a story" in text
    structured = result.structured_content
    assert structured["reply"] == text
    turn = await web_turn(web, structured["turn_id"])
    assert turn.room_id == structured["room_id"]
    assert turn.id == structured["turn_id"]
    # The scripted model streams its reply in pieces: they came as progress, adding up to it.
    assert progress, "no progress notification while the reply streamed"
    assert "".join(m or "" for _, m in progress) == text
    assert [v for v, _ in progress] == sorted(v for v, _ in progress)


async def web_turn(web: Web, turn_id: str) -> runtime_pb2.Turn:
    runtime = RuntimeClient(RpcClient(web.bus), timeout=10)

    async def found() -> runtime_pb2.Turn | None:
        try:
            return await runtime.GetTurn(
                runtime_pb2.GetTurnRequest(agent_id=DEFAULT_AGENT_ID, turn_id=turn_id)
            )
        except ParleyError:
            return None

    return await eventually(found, timeout=20, what="the turn")


async def test_one_conversation_id_is_one_room(web: Web) -> None:
    conversation = f"c-{secrets.token_hex(4)}"
    async with session(web) as client:
        first: Any = await client.call_tool(
            "ask_default", {"message": "first", "conversation_id": conversation}
        )
        second: Any = await client.call_tool(
            "ask_default", {"message": "second", "conversation_id": conversation}
        )
        other: Any = await client.call_tool("ask_default", {"message": "elsewhere"})
    rooms = [r.structured_content["room_id"] for r in (first, second, other)]
    assert rooms[0] == rooms[1] != rooms[2]
    assert first.structured_content["conversation_id"] == conversation
    assert other.structured_content["conversation_id"] != conversation


async def test_bad_arguments_are_a_tool_error_saying_what(web: Web) -> None:
    async with session(web) as client:
        empty: Any = await client.call_tool("ask_default", {"message": " "})
        bad_id: Any = await client.call_tool("ask_default", {"message": "x", "conversation_id": "a b"})
        unknown: Any = await client.call_tool("ask_nobody", {"message": "x"})
    assert empty.is_error
    assert "message is required" in empty.content[0].text
    assert bad_id.is_error
    assert "conversation_id" in bad_id.content[0].text
    assert unknown.is_error
    assert "ask_default" in unknown.content[0].text


async def test_a_wrong_key_is_refused(web: Web) -> None:
    async with httpx.AsyncClient() as http:
        response = await http.post(
            f"{web.url}/mcp",
            json={"jsonrpc": "2.0", "id": 1, "method": "tools/list"},
            headers={"Authorization": "Bearer sk-" + secrets.token_urlsafe(24)},
        )
        missing = await http.post(f"{web.url}/mcp", json={"jsonrpc": "2.0", "id": 1, "method": "tools/list"})
    assert response.status_code == 401
    assert response.json()["error"]["code"] == "INVALID_API_KEY"
    assert missing.status_code == 401
    # The SDK raises its transport's error (in an exception group).
    with pytest.raises(BaseException):  # noqa: B017, PT011
        async with session(web, key="sk-" + secrets.token_urlsafe(24)) as client:
            await client.list_tools()
