"""Streamed replies end to end: the runtime streams the reply's text from the gateway's stream, over
NATS, while the complete reply goes durably to OUTBOUND; a cancel (gRPC, NATS, a connector's cancel
subject) or a newer message in the room stops the slow scripted provider's stream mid-way, and the
turn ends cancelled or superseded with no reply."""

from __future__ import annotations

import asyncio
import re
import secrets
import urllib.request
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc
import pytest
from nats.aio.client import Client
from test_cli import cli_env, run

from parley.v1 import model_pb2, model_pb2_grpc, pairing_pb2, runtime_pb2, runtime_pb2_grpc
from parley.v1.model_nats import ModelGatewayClient
from parley.v1.pairing_nats import PairingClient
from parley.v1.runtime_nats import RuntimeClient
from parley_platform.bus import Bus
from parley_platform.consumer import DEAD_REASON
from parley_platform.rpc import RpcClient
from parley_platform.testing import eventually
from support import (
    DEFAULT_AGENT_ID,
    SessionEnv,
    Suite,
    inbound,
    publish_inbound,
    replies_to,
    stream_messages,
    turn_of,
)

SOURCE = "webtest"
SLOW = "please stream slowly"


@dataclass
class Chunks:
    """Every StreamChunk of the agent's ``SOURCE`` stream subject, by the message answered."""

    by_message: dict[str, list[runtime_pb2.StreamChunk]] = field(default_factory=dict)

    async def on_message(self, msg: object) -> None:
        chunk = runtime_pb2.StreamChunk.FromString(msg.data)  # type: ignore[attr-defined]
        self.by_message.setdefault(chunk.in_reply_to, []).append(chunk)

    def of(self, message: runtime_pb2.InboundMessage) -> list[runtime_pb2.StreamChunk]:
        return self.by_message.get(message.message_id, [])

    async def final(self, message: runtime_pb2.InboundMessage) -> runtime_pb2.StreamChunk:
        async def done() -> runtime_pb2.StreamChunk | None:
            return next((c for c in self.of(message) if c.final), None)

        return await eventually(done, timeout=40, what="the stream's final chunk")


@dataclass
class World:
    suite: Suite
    bus: Bus
    chunks: Chunks
    pairing: PairingClient

    def gateway_cancellations(self) -> float:
        """Model calls the gateway saw cancelled (the provider's stream closed under it)."""
        assert self.suite.gateway is not None
        port = self.suite.gateway.env["PARLEY_GATEWAY_METRICS_PORT"]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
            text = response.read().decode()
        return sum(
            float(m.group(1))
            for m in re.finditer(
                r'^parley_model_requests_total\{[^}]*outcome="CANCELLED"[^}]*\} (\S+)', text, re.M
            )
        )

    def first_chunks(self) -> list[float]:
        """Each runtime replica's count of turns that streamed a first chunk."""
        counts = []
        for runtime in self.suite.runtimes:
            port = runtime.env["PARLEY_RUNTIME_METRICS_PORT"]
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
                text = response.read().decode()
            found = re.search(r"^parley_turn_first_chunk_seconds_count (\S+)", text, re.M)
            counts.append(float(found.group(1)) if found else 0.0)
        return counts

    def provider_saw_cancels(self) -> int:
        assert self.suite.gateway is not None
        return self.suite.gateway.log(tail=100000).count("scripted stream cancelled")

    async def start_slow(self, **kwargs: str) -> runtime_pb2.InboundMessage:
        message = inbound(SLOW, source=SOURCE, **kwargs)
        await publish_inbound(self.bus, message)
        await eventually(lambda: _some(self.chunks.of(message)), timeout=30, what="the first streamed chunk")
        return message

    async def assert_stopped(
        self, message: runtime_pb2.InboundMessage, outcome: str, saw_before: int
    ) -> None:
        final = await self.chunks.final(message)
        assert final.outcome == outcome
        streamed = "".join(c.delta for c in self.chunks.of(message))
        assert "forty" not in streamed  # stopped well before the model's end
        await eventually(
            lambda: _is(self.provider_saw_cancels() > saw_before),
            timeout=20,
            what="the provider's cancellation",
        )
        assert self.gateway_cancellations() >= 1
        await eventually(
            lambda: _is(turn_of(self.suite.env.database_url, message) == (outcome, 1)),
            timeout=20,
            what=f"the turn {outcome}",
        )
        await asyncio.sleep(1)
        assert await replies_to(self.bus, message) == []


async def _some(items: list[runtime_pb2.StreamChunk]) -> bool | None:
    return True if any(c.delta for c in items) else None


async def _is(value: bool) -> bool | None:
    return True if value else None


@pytest.fixture(scope="module")
async def world(test_env: SessionEnv, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[World]:
    ns = f"s{secrets.token_hex(4)}"
    suite = Suite(test_env, tmp_path_factory.mktemp("streaming"), ns)
    try:
        await suite.start(runtimes=2)  # a cancel must find the replica running the turn
        await suite.add_service("parley_pairing", "PAIRING")
        bus = await suite.connect()
        chunks = Chunks()
        await bus.subscribe(bus.subjects.chunks(DEFAULT_AGENT_ID, SOURCE), chunks.on_message)
        try:
            yield World(suite, bus, chunks, PairingClient(RpcClient(bus), timeout=10))
        finally:
            await bus.close()
    finally:
        suite.stop()


async def test_the_chunks_make_the_reply(world: World) -> None:
    message = inbound("tell me something streamed", source=SOURCE)
    await publish_inbound(world.bus, message)
    [reply] = await eventually(lambda: replies_to(world.bus, message), timeout=30, what="the reply")
    final = await world.chunks.final(message)
    chunks = world.chunks.of(message)
    assert [c.sequence for c in sorted(chunks, key=lambda c: c.sequence)] == list(range(1, len(chunks) + 1))
    assert len([c for c in chunks if c.delta]) > 1  # it streamed, not one piece at the end
    assert "".join(c.delta for c in sorted(chunks, key=lambda c: c.sequence)) == reply.text
    assert reply.text == "You said: tell me something streamed"
    assert final.outcome == "completed"
    assert {c.response_id for c in chunks} == {reply.response_id}
    assert {c.turn_id for c in chunks} == {str(_turn_id(message))}
    assert all("<" not in c.delta and "REPLY" not in c.delta for c in chunks)


async def test_an_answer_generated_at_once_is_one_chunk_and_the_final(world: World) -> None:
    """The scripted echo answers without waiting: its pieces reach the runtime together (one message
    of the streamed call) and leave it as one chunk, not one per word."""
    message = inbound("one two three four five six seven eight", source=SOURCE)
    await publish_inbound(world.bus, message)
    [reply] = await eventually(lambda: replies_to(world.bus, message), timeout=30, what="the reply")
    final = await world.chunks.final(message)
    chunks = sorted(world.chunks.of(message), key=lambda c: c.sequence)
    assert (
        "".join(c.delta for c in chunks) == reply.text == "You said: one two three four five six seven eight"
    )
    assert len(chunks) <= 2, [c.delta for c in chunks]
    assert chunks[-1] == final


async def test_a_newer_message_supersedes_the_stream(world: World) -> None:
    saw = world.provider_saw_cancels()
    first = await world.start_slow()
    newer = inbound("never mind", source=SOURCE, channel=first.channel_id)
    await publish_inbound(world.bus, newer)
    await world.assert_stopped(first, "superseded", saw)
    [answer] = await eventually(lambda: replies_to(world.bus, newer), timeout=30, what="the newer reply")
    assert answer.text == "You said: never mind"


async def test_cancel_turn_over_grpc_reaches_the_replica_running_the_turn(world: World) -> None:
    saw = world.provider_saw_cancels()
    before = world.first_chunks()
    message = await world.start_slow()
    after = world.first_chunks()
    [holder] = [i for i, (b, a) in enumerate(zip(before, after, strict=True)) if a > b]
    other = world.suite.runtimes[1 - holder]  # the call lands on the replica NOT running the turn
    request = runtime_pb2.CancelTurnRequest(agent_id="default", turn_id=str(_turn_id(message)))
    async with grpc.aio.insecure_channel(f"127.0.0.1:{other.grpc_port}") as channel:
        stub = runtime_pb2_grpc.RuntimeStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.CancelTurn(request, timeout=10)  # no operator token
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert not any(c.final for c in world.chunks.of(message))
        answer = await stub.CancelTurn(
            request, metadata=[("authorization", f"Bearer {world.suite.env.token}")], timeout=10
        )
    assert answer.cancelled
    assert answer.turn_id == str(_turn_id(message))
    await world.assert_stopped(message, "cancelled", saw)


async def test_cancel_turn_over_nats_by_message_id(world: World) -> None:
    saw = world.provider_saw_cancels()
    message = await world.start_slow()
    runtime = RuntimeClient(RpcClient(world.bus), timeout=10)
    answer = await runtime.CancelTurn(
        runtime_pb2.CancelTurnRequest(agent_id=DEFAULT_AGENT_ID, source=SOURCE, message_id=message.message_id)
    )
    assert answer.cancelled
    assert answer.turn_id == str(_turn_id(message))
    await world.assert_stopped(message, "cancelled", saw)
    again = await runtime.CancelTurn(
        runtime_pb2.CancelTurnRequest(agent_id=DEFAULT_AGENT_ID, turn_id=str(_turn_id(message)))
    )
    assert not again.cancelled  # finished: nothing left to cancel


async def test_a_connector_cancels_its_own_turns_and_only_those(world: World) -> None:
    created = await world.pairing.AddConnector(
        pairing_pb2.AddConnectorRequest(
            name=f"canceller-{secrets.token_hex(3)}", agent_id=DEFAULT_AGENT_ID, source=SOURCE
        )
    )
    name = created.connector.name
    refusals: list[str] = []

    async def on_error(exc: Exception) -> None:
        refusals.append(str(exc).lower())

    nc = Client()
    await nc.connect(
        world.suite.env.endpoints.nats_url,
        user=name,
        password=created.password,
        inbox_prefix=f"_INBOX.connector.{name}",
        error_cb=on_error,
        allow_reconnect=False,
    )
    try:
        ns = world.bus.subjects.ns
        # Another source's cancel subject, even naming this turn: the server refuses it.
        saw = world.provider_saw_cancels()
        message = await world.start_slow()
        request = runtime_pb2.CancelTurnRequest(turn_id=str(_turn_id(message)))
        other = f"{ns}.cancel.{DEFAULT_AGENT_ID}.elsewhere"
        await nc.publish(other, request.SerializeToString())
        await nc.flush()
        await asyncio.sleep(0.5)
        assert any(f'publish to "{other.lower()}"' in r for r in refusals)
        assert not any(c.final for c in world.chunks.of(message))
        # Garbage on its own subject: dead-lettered with a reason (by each replica), the turn runs on.
        await nc.publish(f"{ns}.cancel.{DEFAULT_AGENT_ID}.{SOURCE}", b"\xff\xff not a request")
        await nc.publish(
            f"{ns}.cancel.{DEFAULT_AGENT_ID}.{SOURCE}",
            runtime_pb2.CancelTurnRequest(reason="which?").SerializeToString(),
        )
        dead = await eventually(lambda: _dead_cancels(world.bus), timeout=10, what="the dead letters")
        assert {"not a CancelTurnRequest", "name the turn: turn_id, or message_id with its source"} <= dead
        assert not any(c.final for c in world.chunks.of(message))
        # Its own subject: the turn stops (a request, answered by the replica that runs it).
        own = f"{ns}.cancel.{DEFAULT_AGENT_ID}.{SOURCE}"
        answer = await nc.request(own, request.SerializeToString(), timeout=5)
        assert runtime_pb2.CancelTurnResponse.FromString(answer.data).cancelled
        await world.assert_stopped(message, "cancelled", saw)
    finally:
        await nc.close()


async def test_the_gateway_streams_over_nats_and_a_closed_stream_cancels_the_provider(world: World) -> None:
    saw = world.provider_saw_cancels()
    gateway = ModelGatewayClient(RpcClient(world.bus), timeout=30)
    request = model_pb2.GenerateRequest(
        agent_id=DEFAULT_AGENT_ID,
        model_type=model_pb2.MODEL_TYPE_TEXT_LARGE,
        prompt=f"# Current message\nAnn: {SLOW}",
    )
    pieces: list[str] = []
    stream = gateway.GenerateStream(request)
    async for chunk in stream:
        pieces.append(chunk.text)
        if len(pieces) == 3:
            break
    await stream.aclose()  # type: ignore[attr-defined]
    await eventually(
        lambda: _is(world.provider_saw_cancels() > saw), timeout=20, what="the provider's cancellation"
    )
    whole = [c async for c in gateway.GenerateStream(_echo("whole stream"))]
    assert whole[-1].done
    assert whole[-1].response.text == "".join(c.text for c in whole[:-1])
    assert "You said: whole stream" in whole[-1].response.text


def _echo(text: str) -> model_pb2.GenerateRequest:
    return model_pb2.GenerateRequest(
        agent_id=DEFAULT_AGENT_ID,
        model_type=model_pb2.MODEL_TYPE_TEXT_LARGE,
        prompt=f"# Current message\nAnn: {text}",
    )


def _turn_id(message: runtime_pb2.InboundMessage) -> uuid.UUID:
    return uuid.uuid5(uuid.UUID(DEFAULT_AGENT_ID), f"{message.source}:message:{message.message_id}")


async def test_parley_turns_cancel(world: World) -> None:
    saw = world.provider_saw_cancels()
    message = await world.start_slow()
    env = cli_env(world.suite)
    env["PARLEY_RUNTIME_ADDR"] = f"127.0.0.1:{world.suite.runtimes[0].grpc_port}"
    turn = str(_turn_id(message))
    result = await asyncio.to_thread(run, ["turns", "cancel", "default", turn], env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"turn {turn} cancelled"
    await world.assert_stopped(message, "cancelled", saw)
    again = await asyncio.to_thread(run, ["turns", "cancel", "default", turn], env)
    assert again.returncode == 0, again.stderr
    assert "was not running" in again.stdout
    bad = await asyncio.to_thread(run, ["turns", "cancel", "default", "not-a-uuid"], env)
    assert bad.returncode == 1
    assert "turn_id must be a UUID" in bad.stderr


async def test_a_cancel_racing_the_reply_either_stops_it_or_says_it_was_too_late(world: World) -> None:
    """Cancels fired at random moments of fast turns: ``cancelled`` is true exactly when no reply
    was published, and the stream's final chunk agrees."""
    runtime = RuntimeClient(RpcClient(world.bus), timeout=10)
    messages = [inbound(f"race number {i}", source=SOURCE) for i in range(24)]

    async def race(i: int, message: runtime_pb2.InboundMessage) -> bool:
        await publish_inbound(world.bus, message)
        await asyncio.sleep((i % 12) * 0.06)  # before the turn starts, while it streams, after it
        answer = await runtime.CancelTurn(
            runtime_pb2.CancelTurnRequest(
                agent_id=DEFAULT_AGENT_ID, source=SOURCE, message_id=message.message_id
            )
        )
        return answer.cancelled

    cancelled = await asyncio.gather(*(race(i, m) for i, m in enumerate(messages)))
    assert any(cancelled)  # some landed while their turn ran (12 of 24 in a quiet run)

    async def settled(message: runtime_pb2.InboundMessage) -> tuple[str, int] | None:
        turn = turn_of(world.suite.env.database_url, message)
        return turn if turn and turn[0] != "running" else None

    for message, was_cancelled in zip(messages, cancelled, strict=True):
        state, _ = await eventually(lambda m=message: settled(m), timeout=30, what="the turn to end")  # type: ignore[misc]
        replies = await replies_to(world.bus, message)
        if was_cancelled:
            assert state == "cancelled"
            assert replies == []
        else:
            assert state == "replied"
            assert len(replies) == 1
        final = [c for c in world.chunks.of(message) if c.final]
        if final or was_cancelled:
            final_chunk = await world.chunks.final(message)
            assert final_chunk.outcome == ("cancelled" if was_cancelled else "completed")


async def _dead_cancels(bus: Bus) -> set[str] | None:
    msgs = await stream_messages(bus, bus.subjects.dead("CANCEL"))
    reasons = {(m.headers or {}).get(DEAD_REASON, "") for m in msgs}
    return reasons if len(reasons) >= 2 else None


async def test_a_grpc_client_cancelling_the_gateway_stream_cancels_the_provider(world: World) -> None:
    assert world.suite.gateway is not None
    saw = world.provider_saw_cancels()
    request = model_pb2.GenerateRequest(
        agent_id=DEFAULT_AGENT_ID,
        model_type=model_pb2.MODEL_TYPE_TEXT_LARGE,
        prompt=f"# Current message\nAnn: {SLOW}",
    )
    async with grpc.aio.insecure_channel(f"127.0.0.1:{world.suite.gateway.grpc_port}") as channel:
        call = model_pb2_grpc.ModelGatewayStub(channel).GenerateStream(
            request, metadata=[("authorization", f"Bearer {world.suite.env.token}")], timeout=30
        )
        got = 0
        async for _ in call:
            got += 1
            if got == 2:
                break
        call.cancel()
    await eventually(
        lambda: _is(world.provider_saw_cancels() > saw), timeout=20, what="the provider's cancellation"
    )
