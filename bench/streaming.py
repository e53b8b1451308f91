"""First-chunk latency of a streamed reply through the runtime, against the gateway's own stream.

The runtime and model gateway run as real processes; the scripted model answers after
``--model-latency-ms`` and then writes its ``<response>`` one word every ``--chunk-delay-ms``.
Through the runtime: a connector publishes an inbound message and times the first StreamChunk
with text on ``<ns>.stream.<agent>.<source>``. The floor, in the same run: the same prompt streamed
straight from the gateway over NATS (``ModelGateway.GenerateStream``, as the runtime calls it),
timed to the first piece the reply parser releases (the first word of ``<text>``), and to the
gateway's first item of any kind. The ratio is runtime / gateway at the median. And through the
web connector (pairing and web as processes too): ``POST /v1/chat/completions`` with
``stream: true``, timed to the first server-sent event with content; its ratios to the runtime's
first chunk (what the web service adds) and to the gateway's.

Usage: python bench/streaming.py [--turns 100] [--model-latency-ms 100] [--chunk-delay-ms 10]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import secrets
import time
import uuid
from pathlib import Path

import httpx
import yaml
from _common import Series, bench_env, report, service_process, suite_env

from parley.v1 import model_pb2, pairing_pb2, runtime_pb2
from parley.v1.model_nats import ModelGatewayClient
from parley.v1.pairing_nats import PairingClient
from parley_devinfra.infra import free_port
from parley_platform.bus import Bus
from parley_platform.rpc import RpcClient
from parley_platform.testing import eventually
from parley_runtime.turn.textstream import TextStream

AGENT_ID = str(uuid.uuid5(uuid.UUID("6f1f3f3e-6a0c-5b8e-9a57-5061726c6579"), "agent:default"))
SOURCE = "bench"
ANSWER = "Streaming replies arrive word by word so people see the answer forming as it is written."


def rules(path: Path, latency_ms: float, chunk_delay_ms: float) -> Path:
    path.write_text(
        yaml.safe_dump(
            {
                "rules": [
                    {
                        "match": r"(?s)# Current message\n[^\n:]*: stream bench",
                        "text": ANSWER,
                        "thought": "A short thought first.",
                        "latency_ms": latency_ms,
                        "chunk_delay_ms": chunk_delay_ms,
                    }
                ]
            }
        )
    )
    return path


class Connector:
    """Publishes inbound messages and times each one's first streamed text."""

    def __init__(self, bus: Bus) -> None:
        self.bus = bus
        self.first: dict[str, asyncio.Future[float]] = {}
        self.done: dict[str, asyncio.Future[None]] = {}

    async def start(self) -> None:
        async def on_chunk(msg: object) -> None:
            chunk = runtime_pb2.StreamChunk.FromString(msg.data)  # type: ignore[attr-defined]
            first = self.first.get(chunk.in_reply_to)
            if first is not None and chunk.delta and not first.done():
                first.set_result(time.perf_counter())
            done = self.done.get(chunk.in_reply_to)
            if done is not None and chunk.final and not done.done():
                done.set_result(None)

        await self.bus.nc.subscribe(self.bus.subjects.chunks(AGENT_ID, SOURCE), cb=on_chunk)

    async def turn(self, i: int) -> float:
        message_id = secrets.token_hex(8)
        loop = asyncio.get_running_loop()
        self.first[message_id] = loop.create_future()
        self.done[message_id] = loop.create_future()
        inbound = runtime_pb2.InboundMessage(
            agent_id=AGENT_ID,
            source=SOURCE,
            message_id=message_id,
            sender_id="bench-user",
            sender_name="Bench",
            channel_id=f"room-{i}",
            room_type=runtime_pb2.ROOM_TYPE_DM,
            text="stream bench",
        )
        started = time.perf_counter()
        await self.bus.publish(
            self.bus.subjects.inbound(AGENT_ID, SOURCE),
            inbound.SerializeToString(),
            msg_id=f"{SOURCE}:{message_id}",
        )
        try:
            first = await asyncio.wait_for(self.first[message_id], 60)
            await asyncio.wait_for(self.done[message_id], 60)  # one turn at a time
        finally:
            self.first.pop(message_id)
            self.done.pop(message_id)
        return first - started


async def web_first(http: httpx.AsyncClient, i: int) -> float:
    """The first streamed content of the web connector's OpenAI-compatible endpoint, in seconds."""
    body = {
        "model": "default",
        "user": f"bench-{i}",
        "stream": True,
        "messages": [{"role": "user", "content": "stream bench"}],
    }
    started = time.perf_counter()
    first = 0.0
    async with http.stream("POST", "/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():  # to the end: one turn at a time
            content = line.startswith("data: {") and json.loads(line[6:])["choices"][0]["delta"].get(
                "content"
            )
            if not first and content:
                first = time.perf_counter() - started
    assert first, "the web connector streamed no content"
    return first


async def start_web(bus: Bus, port: int) -> httpx.AsyncClient:
    """A web connector's API key, and an HTTP client that presents it once the service answers."""
    created = await PairingClient(RpcClient(bus), timeout=10).AddConnector(
        pairing_pb2.AddConnectorRequest(name="bench-stream", agent_id=AGENT_ID, source="web", kind="web")
    )
    http = httpx.AsyncClient(
        base_url=f"http://127.0.0.1:{port}",
        headers={"Authorization": f"Bearer {created.api_key}"},
        timeout=60,
    )

    async def answers() -> bool:
        try:
            return (await http.get("/v1/models")).status_code == 200
        except httpx.TransportError:
            return False

    await eventually(answers, timeout=30, what="the web connector")
    return http


async def gateway_first(gateway: ModelGatewayClient) -> tuple[float, float]:
    """(first item, first released reply text) of the gateway's own stream, in seconds."""
    request = model_pb2.GenerateRequest(
        agent_id=AGENT_ID,
        model_type=model_pb2.MODEL_TYPE_TEXT_LARGE,
        prompt="# Current message\nBench: stream bench\n",
    )
    parser = TextStream()
    started = time.perf_counter()
    first_item = first_text = 0.0
    async for chunk in gateway.GenerateStream(request):
        now = time.perf_counter() - started
        first_item = first_item or now
        if not first_text and not chunk.done and parser.feed(chunk.text):
            first_text = now
    return first_item, first_text


async def main(args: argparse.Namespace) -> None:
    with bench_env() as env:
        env.logs.mkdir(parents=True, exist_ok=True)
        settings = {
            **suite_env(env),
            "PARLEY_SCRIPTED_RULES": str(
                rules(env.logs / "rules.yaml", args.model_latency_ms, args.chunk_delay_ms)
            ),
        }
        web_port = free_port()
        gateway = service_process("parley_gateway", env, settings, "gateway").start()
        runtime = service_process("parley_runtime", env, settings, "runtime").start()
        pairing = service_process("parley_pairing", env, settings, "pairing").start()
        web = service_process("parley_web", env, {**settings, "PARLEY_WEB_PORT": str(web_port)}, "web")
        bus = await Bus.connect(env.nats_url, name="bench", namespace=env.namespace)
        http: httpx.AsyncClient | None = None
        try:
            await gateway.wait_ready()
            await runtime.wait_ready()
            await pairing.wait_ready()
            web.start()
            await web.wait_ready()
            http = await start_web(bus, web_port)
            connector = Connector(bus)
            await connector.start()
            client = ModelGatewayClient(RpcClient(bus), timeout=60)
            for i in range(min(5, args.turns)):  # warm-up
                await connector.turn(-i - 1)
                await gateway_first(client)
                await web_first(http, -i - 1)
            through_runtime: list[float] = []
            item: list[float] = []
            text: list[float] = []
            clock = time.perf_counter()
            for i in range(args.turns):
                through_runtime.append(await connector.turn(i))
            runtime_wall = time.perf_counter() - clock
            clock = time.perf_counter()
            for _ in range(args.turns):
                first_item, first_text = await gateway_first(client)
                item.append(first_item)
                text.append(first_text)
            gateway_wall = time.perf_counter() - clock
            through_web: list[float] = []
            clock = time.perf_counter()
            for i in range(args.turns):
                through_web.append(await web_first(http, i))
            web_wall = time.perf_counter() - clock
        finally:
            if http is not None:
                await http.aclose()
            await bus.close()
            web.stop()
            pairing.stop()
            runtime.stop()
            gateway.stop()

    runtime_series = Series("first chunk through the runtime", through_runtime, runtime_wall)
    text_series = Series("gateway stream: first reply text (floor)", text, gateway_wall)
    item_series = Series("gateway stream: first item", item, gateway_wall)
    web_series = Series("first chunk through the web connector", through_web, web_wall)
    summary = {
        "benchmark": "streaming",
        "runtime_first_chunk": runtime_series.figures(),
        "gateway_first_text": text_series.figures(),
        "gateway_first_item": item_series.figures(),
        "first_chunk_ratio_to_gateway": round(runtime_series.p50_ms / text_series.p50_ms, 2),
        "first_chunk_overhead_p50_ms": round(runtime_series.p50_ms - text_series.p50_ms, 3),
        "web_first_chunk": web_series.figures(),
        "web_first_chunk_ratio_to_runtime": round(web_series.p50_ms / runtime_series.p50_ms, 2),
        "web_first_chunk_ratio_to_gateway": round(web_series.p50_ms / text_series.p50_ms, 2),
        "model_latency_ms": args.model_latency_ms,
        "chunk_delay_ms": args.chunk_delay_ms,
    }
    report(
        f"Streamed replies: first chunk (scripted model, {args.model_latency_ms} ms to answer, "
        f"{args.chunk_delay_ms} ms per word)",
        [runtime_series, web_series, text_series, item_series],
        summary,
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=100)
    parser.add_argument("--model-latency-ms", type=float, default=100.0)
    parser.add_argument("--chunk-delay-ms", type=float, default=10.0)
    asyncio.run(main(parser.parse_args()))
