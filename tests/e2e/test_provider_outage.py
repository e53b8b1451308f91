"""The model provider down (its circuit open in the gateway) makes turns wait, not fail: the
runtime holds the messages without spending their deliveries, reports the model missing, and
answers each once when the provider is back. The provider is an OpenAI-compatible HTTP server on
a real socket, answering 503 while "down"; the gateway talks to it with its real client."""

from __future__ import annotations

import asyncio
import json
import re
import urllib.request
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import pytest

from parley_devinfra.faults import health
from parley_platform.testing import eventually
from support import Suite, inbound, inbound_settled, publish_inbound, replies_to, stream_messages


@dataclass
class FakeOpenAI:
    """POST /v1/chat/completions: 503 while ``down``, else a completion in the <response> contract."""

    down: bool = True
    calls: dict[str, int] = field(default_factory=lambda: {"ok": 0, "refused": 0})
    port: int = 0
    _server: asyncio.Server | None = None

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = int(self._server.sockets[0].getsockname()[1])

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(re.search(rb"(?i)content-length: *(\d+)", head).group(1))  # type: ignore[union-attr]
                body = json.loads(await reader.readexactly(length))
                if self.down:
                    self.calls["refused"] += 1
                    status, answer = "503 Service Unavailable", {"error": {"type": "overloaded"}}
                else:
                    self.calls["ok"] += 1
                    said = body["messages"][-1]["content"].rsplit(":", 1)[-1].strip()[:40]
                    content = (
                        f"<response><actions>REPLY</actions><text>provider back: {said}</text></response>"
                    )
                    status = "200 OK"
                    answer = {
                        "id": "c1",
                        "object": "chat.completion",
                        "model": body.get("model", "m"),
                        "choices": [
                            {
                                "index": 0,
                                "message": {"role": "assistant", "content": content},
                                "finish_reason": "stop",
                            }
                        ],
                        "usage": {"prompt_tokens": 10, "completion_tokens": 10, "total_tokens": 20},
                    }
                kind = "application/json"
                data = json.dumps(answer).encode()
                if body.get("stream") and not self.down:  # the runtime streams the reply: SSE
                    kind = "text/event-stream"
                    delta = {"role": "assistant", "content": content}
                    chunks = [
                        {
                            "id": "c1",
                            "object": "chat.completion.chunk",
                            "model": answer["model"],
                            "choices": [{"index": 0, "delta": delta, "finish_reason": None}],
                        },
                        {
                            "id": "c1",
                            "object": "chat.completion.chunk",
                            "model": answer["model"],
                            "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}],
                            "usage": answer["usage"],
                        },
                    ]
                    data = b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks)
                    data += b"data: [DONE]\n\n"
                head = f"HTTP/1.1 {status}\r\ncontent-type: {kind}\r\ncontent-length: {len(data)}"
                writer.write(f"{head}\r\n\r\n".encode() + data)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


@pytest.fixture
async def provider() -> AsyncIterator[FakeOpenAI]:
    server = FakeOpenAI()
    await server.start()
    yield server
    await server.stop()


def dependency_up(port: str, dependency: str) -> float | None:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    found = re.search(rf'^parley_dependency_up\{{dependency="{dependency}"\}} ([0-9.e+]+)$', text, re.M)
    return float(found.group(1)) if found else None


async def test_turns_wait_for_a_provider_whose_circuit_is_open(
    isolated_suite: Suite, provider: FakeOpenAI
) -> None:
    suite = isolated_suite
    suite.gateway = suite.gateway_process(
        PARLEY_MODEL_PROVIDER="openai",
        PARLEY_OPENAI_BASE_URL=f"http://127.0.0.1:{provider.port}/v1",
        PARLEY_OPENAI_API_KEY="sk-test",
        PARLEY_EMBEDDING_PROVIDER="scripted",
        PARLEY_RETRY_ATTEMPTS="1",
        PARLEY_CIRCUIT_FAILURE_THRESHOLD="2",
        PARLEY_CIRCUIT_RESET_SECONDS="1",
    ).start()
    await suite.gateway.wait_ready()
    # max_deliver 2: a provider failure that spent deliveries would dead-letter within a second.
    runtime = await suite.add_runtime(PARLEY_MAX_DELIVER="2")
    bus = await suite.connect()
    try:
        messages = [inbound(f"waiting {i}") for i in range(3)]
        for message in messages:
            await publish_inbound(bus, message)

        async def model_down() -> bool:
            return dependency_up(runtime.env["PARLEY_RUNTIME_METRICS_PORT"], "model") == 0.0

        await eventually(model_down, timeout=30, what="the runtime to report the model missing")
        # Not ready (overall NOT_SERVING), still alive (its own service SERVING: no restart loop).
        assert await health(runtime) == "NOT_SERVING"
        assert await health(runtime, "parley.v1.Runtime") == "SERVING"
        await asyncio.sleep(6)  # several circuit resets and probes: still held
        assert provider.calls["ok"] == 0
        assert provider.calls["refused"] >= 2
        for message in messages:
            assert await replies_to(bus, message) == []
        info = await bus.js.consumer_info(bus.subjects.stream("INBOUND"), "runtime")
        assert info.num_redelivered == 0, "held messages spend no delivery"

        provider.down = False
        for message in messages:
            [reply] = await eventually(
                lambda m=message: replies_to(bus, m), timeout=30, what="the reply once the provider is back"
            )
            assert reply.text == f"provider back: {message.text}"
        await eventually(lambda: inbound_settled(bus), timeout=20, what="every message acked")
        await asyncio.sleep(1)
        for message in messages:
            assert len(await replies_to(bus, message)) == 1
        assert dependency_up(runtime.env["PARLEY_RUNTIME_METRICS_PORT"], "model") == 1.0
        assert await health(runtime) == "SERVING"
        assert await stream_messages(bus, bus.subjects.dead(bus.subjects.stream("INBOUND"))) == []
    finally:
        await bus.close()
