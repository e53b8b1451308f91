"""The web connector's cost: the OpenAI-compatible endpoint against publishing on NATS directly.

The suite runs as real processes (model gateway with the scripted model at zero latency, runtime,
pairing, web). The same turns are taken two ways, in the same run:

- direct: a client publishes the inbound message to JetStream and waits for the reply on the
  outbound subject (and for the first stream chunk on the stream subject): the floor the web
  service adds to; and the same with the reply read through a durable consumer (the connector
  kit), as the web service reads it, which tells JetStream's delivery from the web service's cost;
- web: ``POST /v1/chat/completions`` over HTTP with an API key, one complete reply
  (``stream: false``), or the time to the first streamed content event (``stream: true``).

Printed: p50 latency and throughput of each, and their ratios (web / direct), for complete replies
and for the first chunk.

Usage: python bench/web.py [--sequential 100] [--concurrent 400] [--in-flight 16]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import secrets
import time
import uuid
from collections.abc import Awaitable, Callable

import httpx
from _common import Series, bench_env, report, service_process, suite_env

from parley.v1 import pairing_pb2, runtime_pb2
from parley.v1.pairing_nats import PairingClient
from parley_connectors import Connector
from parley_devinfra.infra import free_port
from parley_platform.bus import Bus
from parley_platform.rpc import RpcClient
from parley_platform.testing import eventually

AGENT_ID = str(uuid.uuid5(uuid.UUID("6f1f3f3e-6a0c-5b8e-9a57-5061726c6579"), "agent:default"))
Op = Callable[[int, int], Awaitable[float | None]]


async def timed(n: int, in_flight: int, op: Op, name: str) -> Series:
    """Run ``op(i, slot)`` n times, at most ``in_flight`` at once. An op returning a number reports
    its own latency (a first chunk); otherwise the whole call is timed."""
    latencies: list[float] = []
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(n):
        queue.put_nowait(i)

    async def worker(slot: int) -> None:
        while not queue.empty():
            i = queue.get_nowait()
            started = time.perf_counter()
            own = await op(i, slot)
            latencies.append(own if own is not None else time.perf_counter() - started)

    started = time.perf_counter()
    await asyncio.gather(*(worker(s) for s in range(in_flight)))
    return Series(name, latencies, time.perf_counter() - started)


async def interleaved(n: int, ops: list[tuple[str, Op]]) -> list[Series]:
    """Each op ``n`` times, one call of each in turn; a Series per op (its wall time is the sum of
    its own calls)."""
    latencies: list[list[float]] = [[] for _ in ops]
    for i in range(n):
        for index, (_, op) in enumerate(ops):
            started = time.perf_counter()
            own = await op(i, 0)
            latencies[index].append(own if own is not None else time.perf_counter() - started)
    return [Series(name, found, sum(found)) for (name, _), found in zip(ops, latencies, strict=True)]


class Direct:
    """A client on the bus: replies and first chunks matched by message id. Replies come from a core
    subscription to the outbound subject (the floor), or, ``durable``, through a durable consumer
    of the connector kit, as the web service receives them (what JetStream's delivery adds)."""

    def __init__(self, bus: Bus, source: str, *, durable: bool = False) -> None:
        self.bus = bus
        self.source = source
        self.durable = durable
        self.replies: dict[str, asyncio.Future[None]] = {}
        self.chunks: dict[str, asyncio.Future[float]] = {}
        self.task: asyncio.Task[None] | None = None

    def _resolve(self, in_reply_to: str) -> None:
        future = self.replies.pop(in_reply_to, None)
        self.chunks.pop(in_reply_to, None)
        if future and not future.done():
            future.set_result(None)

    async def _consume(self, connector: Connector) -> None:
        async for reply in connector.replies(poll=1.0):
            self._resolve(reply.in_reply_to)
            await reply.ack()

    async def start(self) -> None:
        async def on_reply(msg: object) -> None:
            reply = runtime_pb2.OutboundMessage.FromString(msg.data)  # type: ignore[attr-defined]
            self._resolve(reply.in_reply_to)

        async def on_chunk(msg: object) -> None:
            chunk = runtime_pb2.StreamChunk.FromString(msg.data)  # type: ignore[attr-defined]
            future = self.chunks.get(chunk.in_reply_to)
            if future and not future.done() and chunk.delta:
                future.set_result(time.perf_counter())

        if self.durable:
            connector = Connector(
                self.bus,
                source=self.source,
                agent_ids=[AGENT_ID],
                durable=f"{self.source}-direct",
                namespace=self.bus.subjects.ns,
            )
            self.task = asyncio.create_task(self._consume(await connector.start()))
        else:
            await self.bus.nc.subscribe(self.bus.subjects.outbound(AGENT_ID, self.source), cb=on_reply)
        await self.bus.nc.subscribe(f"{self.bus.subjects.ns}.stream.{AGENT_ID}.{self.source}", cb=on_chunk)

    async def send(self, i: int, slot: int) -> tuple[asyncio.Future[None], asyncio.Future[float], float]:
        """Publish message ``i``: (its reply, its first chunk's arrival, when it was sent)."""
        message_id = secrets.token_hex(8)
        loop = asyncio.get_running_loop()
        reply: asyncio.Future[None] = loop.create_future()
        chunk: asyncio.Future[float] = loop.create_future()
        self.replies[message_id] = reply
        self.chunks[message_id] = chunk
        inbound = runtime_pb2.InboundMessage(
            agent_id=AGENT_ID,
            source=self.source,
            message_id=message_id,
            sender_id=f"user-{slot}",
            sender_name=f"User {slot}",
            channel_id=f"room-{slot}",
            room_type=runtime_pb2.ROOM_TYPE_DM,
            text=f"message {i}",
        )
        started = time.perf_counter()
        await self.bus.publish(
            self.bus.subjects.inbound(AGENT_ID, self.source),
            inbound.SerializeToString(),
            msg_id=f"{self.source}:{message_id}",
        )
        return reply, chunk, started

    async def reply(self, i: int, slot: int) -> None:
        reply, _, _ = await self.send(i, slot)
        await asyncio.wait_for(reply, 30)

    async def first_chunk(self, i: int, slot: int) -> float:
        reply, chunk, started = await self.send(i, slot)
        at = await asyncio.wait_for(chunk, 30)
        await asyncio.wait_for(reply, 30)
        return at - started


class Web:
    """An HTTP client of the web service's OpenAI-compatible endpoint."""

    def __init__(self, url: str, key: str, in_flight: int) -> None:
        self.http = httpx.AsyncClient(
            base_url=url,
            headers={"Authorization": f"Bearer {key}"},
            timeout=60,
            limits=httpx.Limits(max_connections=in_flight, max_keepalive_connections=in_flight),
        )

    def body(self, i: int, slot: int, stream: bool) -> dict[str, object]:
        return {
            "model": "default",
            "user": f"user-{slot}",
            "stream": stream,
            "messages": [{"role": "user", "content": f"message {i}"}],
        }

    async def reply(self, i: int, slot: int) -> None:
        response = await self.http.post("/v1/chat/completions", json=self.body(i, slot, False))
        response.raise_for_status()

    async def first_chunk(self, i: int, slot: int) -> float:
        started = time.perf_counter()
        first = None
        async with self.http.stream(
            "POST", "/v1/chat/completions", json=self.body(i, slot, True)
        ) as response:
            response.raise_for_status()
            async for line in response.aiter_lines():
                if first is None and line.startswith("data: {"):
                    delta = json.loads(line[6:])["choices"][0]["delta"]
                    if delta.get("content"):
                        first = time.perf_counter() - started
        assert first is not None, "no content streamed"
        return first


async def main(args: argparse.Namespace) -> None:
    with bench_env() as env:
        common = suite_env(env)
        web_port = free_port()
        processes = [
            service_process("parley_gateway", env, common, "gateway"),
            service_process("parley_pairing", env, common, "pairing"),
            service_process("parley_runtime", env, common, "runtime"),
            service_process("parley_web", env, {**common, "PARLEY_WEB_PORT": str(web_port)}, "web"),
        ]
        bus = await Bus.connect(env.nats_url, name="bench", namespace=env.namespace)
        web: Web | None = None
        direct: Direct | None = None
        durable: Direct | None = None
        try:
            for service in processes:
                service.start()
                await service.wait_ready(timeout=60)
            created = await PairingClient(RpcClient(bus), timeout=10).AddConnector(
                pairing_pb2.AddConnectorRequest(name="bench-web", agent_id=AGENT_ID, source="web", kind="web")
            )
            web = Web(f"http://127.0.0.1:{web_port}", created.api_key, args.in_flight)

            async def answers() -> bool:
                try:
                    return (await web.http.get("/v1/models")).status_code == 200  # type: ignore[union-attr]
                except httpx.TransportError:
                    return False

            await eventually(answers, timeout=30, what="the web service")
            direct = Direct(bus, "bench")
            durable = Direct(bus, "benchd", durable=True)
            await direct.start()
            await durable.start()
            await timed(20, 1, direct.reply, "warm-up")
            await timed(20, 1, durable.reply, "warm-up")
            await timed(20, 1, web.reply, "warm-up")
            # Sequential figures are taken interleaved (one of each in turn), so that the load of a
            # shared machine drifting during the run weighs on each alike.
            direct_seq, web_seq, durable_seq = await interleaved(
                args.sequential,
                [
                    ("direct NATS: reply, sequential", direct.reply),
                    ("web API: reply, sequential", web.reply),
                    ("NATS, durable consumer: reply, sequential", durable.reply),
                ],
            )
            direct_first, web_first = await interleaved(
                args.sequential,
                [
                    ("direct NATS: first chunk, sequential", direct.first_chunk),
                    ("web API: first chunk, sequential", web.first_chunk),
                ],
            )
            rows = [
                direct_seq,
                web_seq,
                durable_seq,
                await timed(
                    args.concurrent,
                    args.in_flight,
                    direct.reply,
                    f"direct NATS: reply, {args.in_flight} in flight",
                ),
                await timed(
                    args.concurrent, args.in_flight, web.reply, f"web API: reply, {args.in_flight} in flight"
                ),
                direct_first,
                web_first,
            ]
        finally:
            if web is not None:
                await web.http.aclose()
            for client in (direct, durable):
                if client is not None and client.task is not None:
                    client.task.cancel()
            await bus.close()
            for service in reversed(processes):
                service.stop()

    direct_conc, web_conc = rows[3], rows[4]
    summary = {
        "benchmark": "web",
        "series": {row.name: row.figures() for row in rows},
        "reply_p50_ratio_to_nats": round(web_seq.p50_ms / direct_seq.p50_ms, 2),
        # The same reply through a durable consumer, without HTTP: how much of the difference is
        # JetStream delivery rather than the web service.
        "reply_p50_ratio_to_nats_durable": round(web_seq.p50_ms / durable_seq.p50_ms, 2),
        "durable_p50_ratio_to_nats": round(durable_seq.p50_ms / direct_seq.p50_ms, 2),
        "reply_throughput_ratio_to_nats": round(web_conc.rate / direct_conc.rate, 2),
        "first_chunk_p50_ratio_to_nats": round(web_first.p50_ms / direct_first.p50_ms, 2),
        "web_first_chunk_p50_ms": round(web_first.p50_ms, 3),
        "web_overhead_p50_ms": round(web_seq.p50_ms - direct_seq.p50_ms, 3),
        "in_flight": args.in_flight,
    }
    report(
        "The web connector against publishing on NATS directly (scripted model, zero latency)", rows, summary
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sequential", type=int, default=100)
    parser.add_argument("--concurrent", type=int, default=400)
    parser.add_argument("--in-flight", type=int, default=16)
    asyncio.run(main(parser.parse_args()))
