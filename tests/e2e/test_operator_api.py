"""The operator gRPC API of the runtime and the model gateway, on the real service processes."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from parley.v1 import common_pb2, model_pb2, model_pb2_grpc, runtime_pb2, runtime_pb2_grpc
from support import DEFAULT_AGENT_ID, Suite


@pytest.fixture
async def channel(suite: Suite) -> AsyncIterator[grpc.aio.Channel]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{suite.runtime.grpc_port}") as opened:
        yield opened


def auth(suite: Suite) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {suite.env.token}")]


async def test_send_message_returns_the_reply(suite: Suite, channel: grpc.aio.Channel) -> None:
    stub = runtime_pb2_grpc.RuntimeStub(channel)
    reply = await stub.SendMessage(
        runtime_pb2.SendMessageRequest(agent_id="default", text="are you there?", timeout_seconds=20),
        metadata=auth(suite),
        timeout=30,
    )
    assert [r.text for r in reply.replies] == ["You said: are you there?"]
    assert reply.replies[0].in_reply_to == reply.message_id


async def test_lists_agents_rooms_and_memories(suite: Suite, channel: grpc.aio.Channel) -> None:
    stub = runtime_pb2_grpc.RuntimeStub(channel)
    sent = await stub.SendMessage(
        runtime_pb2.SendMessageRequest(agent_id="default", text="remember me", sender_id="op-lists"),
        metadata=auth(suite),
        timeout=30,
    )
    agents = await stub.ListAgents(runtime_pb2.ListAgentsRequest(), metadata=auth(suite), timeout=10)
    # Other test modules add agents to the session's database; `default` is always there.
    assert ("default", DEFAULT_AGENT_ID) in [(a.name, a.id) for a in agents.agents]
    assert agents.page.limit == 50
    assert not agents.page.has_more
    assert not agents.page.HasField("next_offset")

    rooms = await stub.ListRooms(
        runtime_pb2.ListRoomsRequest(agent_id="default"), metadata=auth(suite), timeout=10
    )
    room = next(r for r in rooms.rooms if r.channel_id == "operator:op-lists")
    assert room.source == "api"
    assert room.type == runtime_pb2.ROOM_TYPE_API

    memories = await stub.ListMemories(
        runtime_pb2.ListMemoriesRequest(agent_id=DEFAULT_AGENT_ID, room_id=room.id),
        metadata=auth(suite),
        timeout=10,
    )
    assert [m.text for m in memories.memories] == ["You said: remember me", "remember me"]
    assert memories.memories[0].in_reply_to == memories.memories[1].id
    assert sent.replies[0].response_id == memories.memories[0].id

    first = await stub.ListMemories(
        runtime_pb2.ListMemoriesRequest(
            agent_id="default", room_id=room.id, page=common_pb2.PageRequest(limit=1)
        ),
        metadata=auth(suite),
        timeout=10,
    )
    assert len(first.memories) == 1
    assert first.page.has_more
    assert first.page.next_offset == 1


@pytest.mark.parametrize(
    ("request_", "status", "mentions"),
    [
        (
            runtime_pb2.ListMemoriesRequest(agent_id="default", page=common_pb2.PageRequest(limit=101)),
            grpc.StatusCode.INVALID_ARGUMENT,
            "page.limit",
        ),
        (
            runtime_pb2.ListMemoriesRequest(agent_id="default", page=common_pb2.PageRequest(offset=-1)),
            grpc.StatusCode.INVALID_ARGUMENT,
            "page.offset",
        ),
        (
            runtime_pb2.ListMemoriesRequest(agent_id="default", room_id="not-a-uuid"),
            grpc.StatusCode.INVALID_ARGUMENT,
            "room_id",
        ),
        (
            runtime_pb2.ListMemoriesRequest(agent_id="default", table="secrets"),
            grpc.StatusCode.INVALID_ARGUMENT,
            "table",
        ),
        (runtime_pb2.ListMemoriesRequest(agent_id=""), grpc.StatusCode.INVALID_ARGUMENT, "agent_id"),
        (runtime_pb2.ListMemoriesRequest(agent_id="nobody"), grpc.StatusCode.NOT_FOUND, "nobody"),
    ],
)
async def test_invalid_requests_say_what_is_wrong(
    suite: Suite,
    channel: grpc.aio.Channel,
    request_: runtime_pb2.ListMemoriesRequest,
    status: grpc.StatusCode,
    mentions: str,
) -> None:
    stub = runtime_pb2_grpc.RuntimeStub(channel)
    with pytest.raises(grpc.aio.AioRpcError) as failure:
        await stub.ListMemories(request_, metadata=auth(suite), timeout=10)
    assert failure.value.code() == status
    assert mentions in (failure.value.details() or "")


async def test_send_message_rejects_empty_text(suite: Suite, channel: grpc.aio.Channel) -> None:
    stub = runtime_pb2_grpc.RuntimeStub(channel)
    with pytest.raises(grpc.aio.AioRpcError) as failure:
        await stub.SendMessage(
            runtime_pb2.SendMessageRequest(agent_id="default", text="  "), metadata=auth(suite)
        )
    assert failure.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "text" in (failure.value.details() or "")


@pytest.mark.parametrize("metadata", [[], [("authorization", "Bearer wrong")], [("authorization", "token")]])
async def test_missing_or_wrong_token_is_unauthenticated(
    suite: Suite, channel: grpc.aio.Channel, metadata: list[tuple[str, str]]
) -> None:
    stub = runtime_pb2_grpc.RuntimeStub(channel)
    with pytest.raises(grpc.aio.AioRpcError) as failure:
        await stub.ListAgents(runtime_pb2.ListAgentsRequest(), metadata=metadata, timeout=10)
    assert failure.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert suite.env.token not in (failure.value.details() or "")


async def test_health_and_reflection_are_open(suite: Suite, channel: grpc.aio.Channel) -> None:
    health = await health_pb2_grpc.HealthStub(channel).Check(
        health_pb2.HealthCheckRequest(service="parley.v1.Runtime"), timeout=10
    )
    assert health.status == health_pb2.HealthCheckResponse.SERVING

    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    responses = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
    names = [s.name async for r in responses for s in r.list_services_response.service]
    assert "parley.v1.Runtime" in names


async def test_gateway_checks_the_segment_invariant(suite: Suite) -> None:
    assert suite.gateway is not None
    async with grpc.aio.insecure_channel(f"127.0.0.1:{suite.gateway.grpc_port}") as channel:
        stub = model_pb2_grpc.ModelGatewayStub(channel)
        segments = [
            model_pb2.PromptSegment(content="stable ", stable=True),
            model_pb2.PromptSegment(content="part"),
        ]
        ok = await stub.Generate(
            model_pb2.GenerateRequest(
                model_type=model_pb2.MODEL_TYPE_TEXT_LARGE, prompt="stable part", segments=segments
            ),
            metadata=auth(suite),
            timeout=10,
        )
        assert ok.provider == "scripted"
        assert ok.text.startswith("<response>")
        with pytest.raises(grpc.aio.AioRpcError) as failure:
            await stub.Generate(
                model_pb2.GenerateRequest(
                    model_type=model_pb2.MODEL_TYPE_TEXT_LARGE, prompt="stable part!", segments=segments
                ),
                metadata=auth(suite),
                timeout=10,
            )
        assert failure.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "PROMPT_SEGMENTS_MISMATCH" in (failure.value.details() or "")
        with pytest.raises(grpc.aio.AioRpcError) as failure:
            await stub.Generate(model_pb2.GenerateRequest(prompt="hi"), metadata=auth(suite), timeout=10)
        assert failure.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "model_type" in (failure.value.details() or "")
