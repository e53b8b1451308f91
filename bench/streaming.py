"""First-chunk latency of a streamed reply through the runtime, against the gateway's own stream.

The runtime and model gateway run as real processes; the scripted model answers after
``--model-latency-ms`` and then writes its ``<response>`` one word every ``--chunk-delay-ms``.
Through the runtime: a connector publishes an inbound message and times the first StreamChunk
with text on ``<ns>.stream.<agent>.<source>``. The floor, in the same run: the same prompt streamed
straight from the gateway over NATS (``ModelGateway.GenerateStream``, as the runtime calls it),
timed to the first piece the reply parser releases (the first word of ``<text>``), and to the
gateway's first item of any kind. The ratio is runtime / gateway at the median.

Usage: python bench/streaming.py [--turns 100] [--model-latency-ms 100] [--chunk-delay-ms 10]
"""

from __future__ import annotations

import argparse
import asyncio
import secrets
import time
import uuid
from pathlib import Path

import yaml
from _common import Series, bench_env, report, service_process, suite_env

from parley.v1 import model_pb2, runtime_pb2
from parley.v1.model_nats import ModelGatewayClient
from parley_platform.bus import Bus
from parley_platform.rpc import RpcClient
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
        gateway = service_process("parley_gateway", env, settings, "gateway").start()
        runtime = service_process("parley_runtime", env, settings, "runtime").start()
        bus = await Bus.connect(env.nats_url, name="bench", namespace=env.namespace)
        try:
            await gateway.wait_ready()
            await runtime.wait_ready()
            connector = Connector(bus)
            await connector.start()
            client = ModelGatewayClient(RpcClient(bus), timeout=60)
            for i in range(min(5, args.turns)):  # warm-up
                await connector.turn(-i - 1)
                await gateway_first(client)
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
        finally:
            await bus.close()
            runtime.stop()
            gateway.stop()

    runtime_series = Series("first chunk through the runtime", through_runtime, runtime_wall)
    text_series = Series("gateway stream: first reply text (floor)", text, gateway_wall)
    item_series = Series("gateway stream: first item", item, gateway_wall)
    summary = {
        "benchmark": "streaming",
        "runtime_first_chunk": runtime_series.figures(),
        "gateway_first_text": text_series.figures(),
        "gateway_first_item": item_series.figures(),
        "first_chunk_ratio_to_gateway": round(runtime_series.p50_ms / text_series.p50_ms, 2),
        "first_chunk_overhead_p50_ms": round(runtime_series.p50_ms - text_series.p50_ms, 3),
        "model_latency_ms": args.model_latency_ms,
        "chunk_delay_ms": args.chunk_delay_ms,
    }
    report(
        f"Streamed replies: first chunk (scripted model, {args.model_latency_ms} ms to answer, "
        f"{args.chunk_delay_ms} ms per word)",
        [runtime_series, text_series, item_series],
        summary,
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=100)
    parser.add_argument("--model-latency-ms", type=float, default=100.0)
    parser.add_argument("--chunk-delay-ms", type=float, default=10.0)
    asyncio.run(main(parser.parse_args()))
