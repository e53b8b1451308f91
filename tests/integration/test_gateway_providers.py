"""The OpenAI and Anthropic providers against local HTTP servers that speak those wire protocols over a
real loopback socket: success, SSE streaming, 429 with Retry-After, 5xx, timeouts, malformed bodies,
cache markers and cached-token usage; through the engine, so retries, the breaker and the
concurrency limit are the real ones."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from parley_gateway.engine import Budgets, Call, Engine, GatewayMetrics, Ledger, Protected
from parley_gateway.protection import CircuitBreaker, Limiter, RetryPolicy
from parley_gateway.provider import Chunk, ProviderRequest, Segment
from parley_gateway.remote import AnthropicProvider, ModelNames, OpenAIEmbedder, OpenAIProvider
from parley_gateway.scripted import ScriptedEmbedder
from parley_gateway.store import GatewayStore
from parley_platform.errors import ParleyError
from parley_platform.postgres import Database
from parley_platform.testing import eventually

KEY = "sk-test-secret-key-never-echoed"


@dataclass
class Reply:
    status: int = 200
    body: bytes | None = None
    headers: dict[str, str] = field(default_factory=dict)
    events: list[str] | None = None  # server-sent events, written one by one
    hang: bool = False  # never answer: the client's timeout must fire


@dataclass
class Seen:
    method: str
    path: str
    headers: dict[str, str]
    body: Any


Handler = Callable[[Seen], Reply]


class FakeServer:
    """A minimal HTTP/1.1 server on 127.0.0.1: one request per connection, replies from ``handler``."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.seen: list[Seen] = []
        self.never = asyncio.Event()
        self.server: asyncio.Server | None = None

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        port = self.server.sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}"

    async def stop(self) -> None:
        assert self.server is not None
        self.server.close()
        self.never.set()
        await self.server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            lines = head.decode().split("\r\n")
            method, path, _ = lines[0].split(" ", 2)
            headers = {
                k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:] if line)
            }
            raw = await reader.readexactly(int(headers.get("content-length", "0")))
            seen = Seen(method, path, headers, json.loads(raw) if raw else None)
            self.seen.append(seen)
            reply = self.handler(seen)
            if reply.hang:
                await self.never.wait()
                return
            if reply.events is not None:
                writer.write(
                    f"HTTP/1.1 {reply.status} OK\r\ncontent-type: text/event-stream\r\n"
                    "connection: close\r\n\r\n".encode()
                )
                for event in reply.events:
                    writer.write(event.encode())
                    await writer.drain()
            else:
                body = reply.body or b""
                extra = "".join(f"{k}: {v}\r\n" for k, v in reply.headers.items())
                writer.write(
                    f"HTTP/1.1 {reply.status} X\r\ncontent-type: application/json\r\n"
                    f"content-length: {len(body)}\r\n{extra}connection: close\r\n\r\n".encode()
                    + body
                )
            await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


@pytest.fixture
async def fake() -> AsyncIterator[Callable[[Handler], Awaitable[tuple[FakeServer, str]]]]:
    servers: list[FakeServer] = []

    async def start(handler: Handler) -> tuple[FakeServer, str]:
        server = FakeServer(handler)
        servers.append(server)
        return server, await server.start()

    yield start
    for server in servers:
        await server.stop()


def engine_for(
    provider: Any, *, attempts: int = 3, threshold: int = 5, timeout: float = 5.0
) -> tuple[Engine, GatewayMetrics]:
    store = GatewayStore(Database("postgresql://unused@127.0.0.1:1/none"))
    metrics = GatewayMetrics(CollectorRegistry())
    protected = Protected(
        provider, Limiter(provider.name, 4, 16), CircuitBreaker(provider.name, threshold, 60)
    )
    engine = Engine(
        routes={t: protected for t in ("TEXT_SMALL", "TEXT_LARGE", "OBJECT_SMALL", "OBJECT_LARGE")},
        embedder=ScriptedEmbedder(),
        budgets=Budgets(store, default_tokens=0, window_seconds=3600, cache_seconds=5),
        ledger=Ledger(store, 1.0),
        metrics=metrics,
        retry=RetryPolicy(attempts=attempts, base_delay=0.01, max_delay=0.05),
        provider_timeout=timeout,
        default_max_tokens=64,
    )
    return engine, metrics


SEGMENTED = ProviderRequest(
    model_type="TEXT_LARGE",
    prompt="[volatile] [stable-a] [stable-b]",
    system="be kind",
    segments=(Segment("[volatile] ", False), Segment("[stable-a] ", True), Segment("[stable-b]", True)),
)


def openai(url: str) -> OpenAIProvider:
    return OpenAIProvider(
        base_url=url + "/v1", api_key=KEY, models=ModelNames("mini", "big"), embedding_dimension=3
    )


def chat_body(text: str = "hello", cached: int = 0) -> bytes:
    return json.dumps(
        {
            "id": "c1",
            "choices": [
                {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}
            ],
            "usage": {
                "prompt_tokens": 20,
                "completion_tokens": 3,
                "prompt_tokens_details": {"cached_tokens": cached},
            },
        }
    ).encode()


async def test_openai_chat_puts_stable_segments_first_and_reports_cached_tokens(fake: Any) -> None:
    server, url = await fake(lambda seen: Reply(body=chat_body("hi!", cached=16)))
    provider = openai(url)
    engine, _ = engine_for(provider)
    try:
        result = await engine.generate(Call("", SEGMENTED))
    finally:
        await provider.close()
    assert (result.completion.text, result.provider, result.model) == ("hi!", "openai", "big")
    assert (result.completion.input_tokens, result.completion.output_tokens) == (20, 3)
    assert result.completion.cached_input_tokens == 16
    [seen] = server.seen
    assert (seen.method, seen.path) == ("POST", "/v1/chat/completions")
    assert seen.headers["authorization"] == f"Bearer {KEY}"
    assert seen.body["messages"] == [
        {"role": "system", "content": "be kind"},
        {"role": "user", "content": "[stable-a] [stable-b][volatile] "},
    ]
    assert seen.body["max_tokens"] == 64


async def test_openai_streams_server_sent_events(fake: Any) -> None:
    def events(seen: Seen) -> Reply:
        chunks = [
            {"choices": [{"index": 0, "delta": {"content": piece}}]} for piece in ("Hel", "lo", " there")
        ]
        chunks.append({"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]})
        chunks.append({"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 3}})
        return Reply(events=[f"data: {json.dumps(c)}\n\n" for c in chunks] + ["data: [DONE]\n\n"])

    server, url = await fake(events)
    provider = openai(url)
    engine, _ = engine_for(provider)
    try:
        items = [item async for item in engine.stream(Call("", SEGMENTED, kind="stream"))]
    finally:
        await provider.close()
    assert [i.text for i in items if isinstance(i, Chunk)] == ["Hel", "lo", " there"]
    final = items[-1]
    assert not isinstance(final, Chunk)
    assert (final.completion.text, final.completion.finish_reason) == ("Hello there", "length")
    assert (final.completion.input_tokens, final.completion.output_tokens) == (7, 3)
    assert server.seen[0].body["stream"] is True


async def test_429_is_retried_after_the_providers_retry_after(fake: Any) -> None:
    replies = iter(
        [Reply(429, b'{"error": {"type": "rate_limit"}}', {"retry-after": "0.2"}), Reply(body=chat_body())]
    )
    server, url = await fake(lambda seen: next(replies))
    provider = openai(url)
    engine, metrics = engine_for(provider)
    loop = asyncio.get_running_loop()
    started = loop.time()
    try:
        result = await engine.generate(Call("", SEGMENTED))
    finally:
        await provider.close()
    assert result.completion.text == "hello"
    assert len(server.seen) == 2
    assert loop.time() - started >= 0.2  # Retry-After is a floor under the jittered backoff
    assert metrics.retries.labels("openai", "PROVIDER_RATE_LIMITED")._value.get() == 1


async def test_429_without_luck_is_rate_limited(fake: Any) -> None:
    server, url = await fake(lambda seen: Reply(429, b"{}", {"retry-after": "0"}))
    provider = openai(url)
    engine, _ = engine_for(provider, attempts=2)
    try:
        with pytest.raises(ParleyError) as caught:
            await engine.generate(Call("", SEGMENTED))
    finally:
        await provider.close()
    assert caught.value.code == "PROVIDER_RATE_LIMITED"
    assert caught.value.kind.name == "RESOURCE_EXHAUSTED"
    assert len(server.seen) == 2


async def test_5xx_is_retried_then_unavailable_then_the_circuit_opens(fake: Any) -> None:
    server, url = await fake(lambda seen: Reply(503, b'{"error": {"type": "overloaded"}}'))
    provider = openai(url)
    engine, _ = engine_for(provider, attempts=2, threshold=4)
    try:
        for _ in range(2):
            with pytest.raises(ParleyError) as caught:
                await engine.generate(Call("", SEGMENTED))
            assert caught.value.code == "PROVIDER_UNAVAILABLE"
            assert "503" in caught.value.message
        assert len(server.seen) == 4
        with pytest.raises(ParleyError) as opened:
            await engine.generate(Call("", SEGMENTED))
    finally:
        await provider.close()
    assert opened.value.code == "CIRCUIT_OPEN"
    assert len(server.seen) == 4  # the open circuit did not call the provider
    assert engine.route("TEXT_LARGE").breaker.state == "open"


async def test_a_provider_that_never_answers_times_out(fake: Any) -> None:
    _server, url = await fake(lambda seen: Reply(hang=True))
    provider = openai(url)
    engine, _ = engine_for(provider, attempts=1, timeout=0.3)
    try:
        with pytest.raises(ParleyError) as caught:
            await engine.generate(Call("", SEGMENTED))
    finally:
        await provider.close()
    assert caught.value.code == "PROVIDER_TIMEOUT"
    assert caught.value.retryable


@pytest.mark.parametrize(
    "body",
    [b"this is not json", b"[1, 2]", b'{"choices": []}', b'{"choices": [{"message": {"content": 42}}]}'],
    ids=["not-json", "not-object", "no-choices", "non-text"],
)
async def test_malformed_bodies_are_bad_responses_and_not_retried(fake: Any, body: bytes) -> None:
    server, url = await fake(lambda seen: Reply(body=body))
    provider = openai(url)
    engine, _ = engine_for(provider)
    try:
        with pytest.raises(ParleyError) as caught:
            await engine.generate(Call("", SEGMENTED))
    finally:
        await provider.close()
    assert caught.value.code == "PROVIDER_BAD_RESPONSE"
    assert len(server.seen) == 1


async def test_auth_failure_never_echoes_the_key(fake: Any) -> None:
    server, url = await fake(
        lambda seen: Reply(401, json.dumps({"error": {"type": "invalid_api_key", "key": KEY}}).encode())
    )
    provider = openai(url)
    engine, _ = engine_for(provider)
    try:
        with pytest.raises(ParleyError) as caught:
            await engine.generate(Call("", SEGMENTED))
    finally:
        await provider.close()
    assert caught.value.code == "PROVIDER_AUTH_FAILED"
    assert KEY not in str(caught.value)
    assert len(server.seen) == 1


async def test_openai_embeddings_and_their_dimension(fake: Any) -> None:
    def embeddings(seen: Seen) -> Reply:
        data = [{"index": i, "embedding": [float(i), 0.5, 1.0]} for i, _ in enumerate(seen.body["input"])]
        return Reply(body=json.dumps({"data": data, "usage": {"prompt_tokens": 4}}).encode())

    server, url = await fake(embeddings)
    provider = openai(url)
    try:
        result = await OpenAIEmbedder(provider).embed(["a", "b"], timeout=5)
        provider.dimension = 4
        with pytest.raises(ParleyError) as caught:
            await provider.embed(["a"], timeout=5)
    finally:
        await provider.close()
    assert result.vectors == [[0.0, 0.5, 1.0], [1.0, 0.5, 1.0]]
    assert (result.dimension, result.input_tokens) == (3, 4)
    assert caught.value.code == "PROVIDER_BAD_RESPONSE"
    assert server.seen[0].path == "/v1/embeddings"


def anthropic(url: str) -> AnthropicProvider:
    return AnthropicProvider(base_url=url, api_key=KEY, models=ModelNames("haiku", "sonnet"))


async def test_anthropic_marks_stable_blocks_for_the_cache_and_reports_cache_reads(fake: Any) -> None:
    body = {
        "content": [{"type": "text", "text": "bonjour"}],
        "stop_reason": "end_turn",
        "usage": {
            "input_tokens": 5,
            "output_tokens": 2,
            "cache_read_input_tokens": 30,
            "cache_creation_input_tokens": 0,
        },
    }
    server, url = await fake(lambda seen: Reply(body=json.dumps(body).encode()))
    provider = anthropic(url)
    engine, _ = engine_for(provider)
    request = ProviderRequest(
        model_type="TEXT_SMALL",
        prompt="character|format|history|now",
        system="sys",
        segments=(
            Segment("character|", True),
            Segment("format|", True),
            Segment("history|", False),
            Segment("now", False),
        ),
    )
    try:
        result = await engine.generate(Call("", request))
    finally:
        await provider.close()
    assert result.completion.text == "bonjour"
    assert (result.completion.input_tokens, result.completion.cached_input_tokens) == (35, 30)
    [seen] = server.seen
    assert seen.path == "/v1/messages"
    assert seen.headers["x-api-key"] == KEY
    assert seen.headers["anthropic-version"] == "2023-06-01"
    assert seen.body["model"] == "haiku"
    assert seen.body["system"] == [{"type": "text", "text": "sys", "cache_control": {"type": "ephemeral"}}]
    # Anthropic keeps the caller's order; the marker closes the run of stable blocks.
    assert seen.body["messages"] == [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "character|"},
                {"type": "text", "text": "format|", "cache_control": {"type": "ephemeral"}},
                {"type": "text", "text": "history|"},
                {"type": "text", "text": "now"},
            ],
        }
    ]


def anthropic_events(*, error_first: bool = False) -> list[str]:
    def event(name: str, data: dict[str, Any]) -> str:
        return f"event: {name}\ndata: {json.dumps({'type': name, **data})}\n\n"

    events = [
        event("message_start", {"message": {"usage": {"input_tokens": 9, "cache_read_input_tokens": 4}}})
    ]
    if error_first:
        return [*events, event("error", {"error": {"type": "overloaded_error", "message": "busy"}})]
    events += [event("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}})]
    events += [
        event("content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": t}})
        for t in ("Bon", "jour")
    ]
    events += [
        ": a comment line\n\n",
        event("content_block_stop", {"index": 0}),
        event("message_delta", {"delta": {"stop_reason": "max_tokens"}, "usage": {"output_tokens": 2}}),
        event("message_stop", {}),
    ]
    return events


async def test_anthropic_streams_and_retries_an_overloaded_start(fake: Any) -> None:
    replies = iter([Reply(events=anthropic_events(error_first=True)), Reply(events=anthropic_events())])
    server, url = await fake(lambda seen: next(replies))
    provider = anthropic(url)
    engine, _ = engine_for(provider)
    try:
        items = [i async for i in engine.stream(Call("", SEGMENTED, kind="stream"))]
    finally:
        await provider.close()
    assert len(server.seen) == 2
    assert [i.text for i in items if isinstance(i, Chunk)] == ["Bon", "jour"]
    final = items[-1]
    assert not isinstance(final, Chunk)
    assert final.completion.text == "Bonjour"
    assert final.completion.finish_reason == "max_tokens"
    assert (
        final.completion.input_tokens,
        final.completion.output_tokens,
        final.completion.cached_input_tokens,
    ) == (
        13,
        2,
        4,
    )


@pytest.mark.parametrize(
    ("events", "code"),
    [
        (["event: message_start\ndata: {not json\n\n"], "PROVIDER_BAD_RESPONSE"),
        (
            ['event: message_start\ndata: {"type": "message_start", "message": {}}\n\n'],
            "PROVIDER_BAD_RESPONSE",
        ),
    ],
    ids=["not-json", "no-message-stop"],
)
async def test_anthropic_malformed_streams(fake: Any, events: list[str], code: str) -> None:
    server, url = await fake(lambda seen: Reply(events=events))
    provider = anthropic(url)
    engine, _ = engine_for(provider)
    try:
        with pytest.raises(ParleyError) as caught:
            async for _ in engine.stream(Call("", SEGMENTED, kind="stream")):
                pass
    finally:
        await provider.close()
    assert caught.value.code == code
    assert len(server.seen) == 1


async def test_anthropic_overloaded_529_is_unavailable(fake: Any) -> None:
    server, url = await fake(
        lambda seen: Reply(529, b'{"type": "error", "error": {"type": "overloaded_error"}}')
    )
    provider = anthropic(url)
    engine, _ = engine_for(provider, attempts=3)
    try:
        with pytest.raises(ParleyError) as caught:
            await engine.generate(Call("", SEGMENTED))
    finally:
        await provider.close()
    assert caught.value.code == "PROVIDER_UNAVAILABLE"
    assert "overloaded_error" in caught.value.message
    assert len(server.seen) == 3


async def test_the_concurrency_limit_queues_then_refuses(fake: Any) -> None:
    _server, url = await fake(lambda seen: Reply(hang=True))
    provider = openai(url)
    store = GatewayStore(Database("postgresql://unused@127.0.0.1:1/none"))
    protected = Protected(provider, Limiter("openai", 2, 1), CircuitBreaker("openai", 5, 60))
    engine = Engine(
        routes={"TEXT_SMALL": protected},
        embedder=ScriptedEmbedder(),
        budgets=Budgets(store, default_tokens=0, window_seconds=60, cache_seconds=5),
        ledger=Ledger(store, 1.0),
        metrics=GatewayMetrics(CollectorRegistry()),
        retry=RetryPolicy(attempts=1),
        provider_timeout=5,
        default_max_tokens=8,
    )
    request = ProviderRequest(model_type="TEXT_SMALL", prompt="x")
    running = [asyncio.create_task(engine.generate(Call("", request))) for _ in range(3)]
    try:

        async def full() -> bool:
            return protected.limiter.inflight == 2 and protected.limiter.queued == 1

        await eventually(full, what="two calls running and one queued")
        with pytest.raises(ParleyError) as caught:
            await engine.generate(Call("", request))
        assert caught.value.code == "PROVIDER_BUSY"
        assert caught.value.kind.name == "RESOURCE_EXHAUSTED"
    finally:
        for task in running:
            task.cancel()
        await asyncio.gather(*running, return_exceptions=True)
        await provider.close()
    assert protected.limiter.inflight == 0
    assert protected.breaker.state == "closed"  # cancelled calls say nothing about the provider
