"""The web connector's test fixture: the suite (gateway, runtime, pairing) and a web service as real
processes in a namespace of their own, a web connector's API key, the official OpenAI client."""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import httpx
import openai
import pytest

from parley.v1 import pairing_pb2, runtime_pb2
from parley.v1.pairing_nats import PairingClient
from parley_devinfra.infra import free_port
from parley_platform.bus import Bus
from parley_platform.rpc import RpcClient
from parley_platform.testing import eventually
from support import DEFAULT_AGENT_ID, SessionEnv, Suite, replies_to


@dataclass
class Web:
    suite: Suite
    bus: Bus
    pairing: PairingClient
    url: str
    key: str
    name: str
    clients: list[openai.AsyncOpenAI] = field(default_factory=list)

    def client(self, key: str | None = None, url: str | None = None) -> openai.AsyncOpenAI:
        """The official client (no retries: each request is one message), closed after the module."""
        made = openai.AsyncOpenAI(
            base_url=f"{url or self.url}/v1", api_key=key or self.key, max_retries=0, timeout=60
        )
        self.clients.append(made)
        return made

    async def add_key(self, name: str) -> str:
        created = await self.pairing.AddConnector(
            pairing_pb2.AddConnectorRequest(name=name, agent_id=DEFAULT_AGENT_ID, source="web", kind="web")
        )
        return created.api_key

    async def reply_to(self, completion_id: str) -> runtime_pb2.OutboundMessage:
        """The reply on the OUTBOUND stream to the message a completion id names."""
        message = runtime_pb2.InboundMessage(
            agent_id=DEFAULT_AGENT_ID, source="web", message_id=completion_id.removeprefix("chatcmpl-")
        )
        [reply] = await eventually(lambda: replies_to(self.bus, message), timeout=20, what="the reply")
        return reply


async def start_web(suite: Suite, **extra: str) -> str:
    port = free_port()
    await suite.add_service("parley_web", "WEB", PARLEY_WEB_PORT=str(port), **extra)

    async def answers() -> bool:
        async with httpx.AsyncClient() as http:
            try:
                return (await http.get(f"http://127.0.0.1:{port}/")).status_code == 200
            except httpx.TransportError:
                return False

    await eventually(answers, timeout=20, what="the web service's HTTP port")
    return f"http://127.0.0.1:{port}"


async def web_fixture(test_env: SessionEnv, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Web]:
    suite = Suite(test_env, tmp_path_factory.mktemp("web"), f"w{secrets.token_hex(4)}")
    try:
        await suite.start(runtimes=1)
        await suite.add_service("parley_pairing", "PAIRING")
        # Checked keys are not cached: a revocation counts at once.
        url = await start_web(suite, PARLEY_WEB_CACHE_SECONDS="0")
        bus = await suite.connect()
        try:
            pairing = PairingClient(RpcClient(bus), timeout=10)
            web = Web(suite, bus, pairing, url, "", f"site-{secrets.token_hex(3)}")
            web.key = await web.add_key(web.name)
            try:
                yield web
            finally:
                for client in web.clients:
                    await client.close()
        finally:
            await bus.close()
    finally:
        suite.stop()
