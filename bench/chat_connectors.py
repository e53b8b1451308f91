"""The Telegram connector's round trip against the connector kit's own, in the same run.

A user's message goes in as a Telegram update (a fake Bot API server on loopback, long polled by
the real ``parley_telegram`` process through python-telegram-bot) and comes back as the bot's
``sendMessage``; the floor is the same turn through the kit alone (``Connector.send`` →
``replies()``, measured before and after, the faster run counting), so the ratio is what
polling, mapping and the Bot API calls add. The runtime, model gateway and pairing service run
as real processes, the scripted model at zero latency.

Usage: python bench/chat_connectors.py [--turns 100]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import secrets
import time
import uuid
from pathlib import Path

from _common import BenchEnv, Series, bench_env, report, service_process, suite_env

from parley.v1 import pairing_pb2
from parley.v1.pairing_nats import PairingClient
from parley_cli.connectors_commands import credentials
from parley_connectors import Connector, Credentials, Inbound
from parley_devinfra.fake_telegram import FakeTelegram, Sent
from parley_devinfra.infra import free_port
from parley_platform.bus import Bus
from parley_platform.rpc import RpcClient
from parley_platform.testing import ServiceProcess

AGENT_ID = str(uuid.uuid5(uuid.UUID("6f1f3f3e-6a0c-5b8e-9a57-5061726c6579"), "agent:default"))
TOKEN = f"7000001:{secrets.token_urlsafe(24)}"


async def write_credentials(env: BenchEnv, pairing: PairingClient, source: str) -> Path:
    created = await pairing.AddConnector(
        pairing_pb2.AddConnectorRequest(
            name=f"bench-{source}-{secrets.token_hex(3)}", agent_id=AGENT_ID, source=source
        )
    )
    path = env.logs / f"{created.connector.name}.json"
    path.write_text(json.dumps(credentials(created, env.endpoints.nats_url)))
    return path


async def kit_round_trips(creds: Path, turns: int) -> Series:
    async with await Connector.connect(Credentials.load(creds)) as conn:
        replies = conn.replies(poll=1.0)
        latencies: list[float] = []
        started = time.perf_counter()
        for i in range(turns + 5):
            began = time.perf_counter()
            await conn.send(
                Inbound(message_id=uuid.uuid4().hex, sender_id="bench", text=f"hello {i}", channel_id="kit")
            )
            reply = await anext(replies)
            await reply.ack()
            if i >= 5:  # warm-up
                latencies.append(time.perf_counter() - began)
        await replies.aclose()
        return Series("kit: send → reply (floor)", latencies, time.perf_counter() - started)


async def telegram_round_trips(telegram: FakeTelegram, turns: int) -> Series:
    arrived: asyncio.Queue[Sent] = asyncio.Queue()
    telegram.on_sent = arrived.put_nowait
    latencies: list[float] = []
    started = time.perf_counter()
    for i in range(turns + 5):
        began = time.perf_counter()
        await telegram.push(telegram.message(f"hello {i}", chat_id=5000 + i))
        sent = await asyncio.wait_for(arrived.get(), 30)
        assert sent.chat_id == 5000 + i, "a reply for another chat"
        if i >= 5:
            latencies.append(time.perf_counter() - began)
    return Series("telegram: update → sendMessage", latencies, time.perf_counter() - started)


async def main(args: argparse.Namespace) -> None:
    with bench_env() as env:
        settings = suite_env(env)
        gateway = service_process("parley_gateway", env, settings, "gateway").start()
        runtime = service_process("parley_runtime", env, settings, "runtime").start()
        pairing_port = free_port()
        pairing_service = ServiceProcess(
            "parley_pairing",
            {
                **settings,
                "PARLEY_PAIRING_GRPC_PORT": str(pairing_port),
                "PARLEY_PAIRING_METRICS_PORT": str(free_port()),
            },
            env.logs / "pairing.log",
            pairing_port,
        ).start()
        telegram = await FakeTelegram(TOKEN).start()
        connector: ServiceProcess | None = None
        bus = await Bus.connect(env.nats_url, name="bench", namespace=env.namespace)
        try:
            for process in (gateway, runtime, pairing_service):
                await process.wait_ready()
            pairing = PairingClient(RpcClient(bus), timeout=10)
            kit_creds = await write_credentials(env, pairing, "benchkit")
            telegram_creds = await write_credentials(env, pairing, "telegram")
            connector = ServiceProcess(
                "parley_telegram",
                {
                    **settings,
                    "PARLEY_CONNECTOR_CREDENTIALS": str(telegram_creds),
                    "PARLEY_CONNECTOR_STATE": str(env.logs / "telegram.sqlite"),
                    "PARLEY_TELEGRAM_TOKEN": TOKEN,
                    "PARLEY_TELEGRAM_API_URL": telegram.base_url,
                    "PARLEY_TELEGRAM_POLL_SECONDS": "10",
                },
                env.logs / "telegram.log",
                0,
            ).start()
            before = await kit_round_trips(kit_creds, args.turns)
            measured = await telegram_round_trips(telegram, args.turns)
            after = await kit_round_trips(kit_creds, args.turns)  # the faster of two runs is the floor
            floor = min(before, after, key=lambda series: series.p50_ms)
        finally:
            if connector is not None:
                connector.stop()
            await bus.close()
            await telegram.stop()
            for process in (pairing_service, runtime, gateway):
                process.stop()
        ratio = measured.p50_ms / floor.p50_ms
        report(
            f"Telegram connector round trip vs the connector kit ({args.turns} sequential turns)",
            [floor, measured],
            {
                "benchmark": "chat_connectors",
                "telegram_p50_ratio_to_kit": round(ratio, 2),
                "telegram_p50_ms": round(measured.p50_ms, 2),
                "kit_p50_ms": round(floor.p50_ms, 2),
                "telegram": measured.figures(),
                "kit": floor.figures(),
            },
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=100)
    asyncio.run(main(parser.parse_args()))
