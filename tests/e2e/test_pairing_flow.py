"""Pairing through the runtime: an unknown sender's DM gets the pairing code once and no model
call; after `parley pairing approve` the next message gets a real answer; with the pairing
service down the runtime fails closed."""

from __future__ import annotations

import asyncio
import os
import re
import secrets
import subprocess
import sys
import urllib.request
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from parley.v1 import pairing_pb2, runtime_pb2
from parley.v1.pairing_nats import PairingClient
from parley_platform import permissions
from parley_platform.bus import Bus
from parley_platform.rpc import RpcClient
from parley_platform.testing import eventually
from support import (
    ROOT,
    SessionEnv,
    Suite,
    inbound,
    inbound_settled,
    publish_inbound,
    replies_to,
    scraped,
    stream_messages,
)

PARLEY = str(Path(sys.executable).parent / "parley")


class Flow:
    def __init__(self, suite: Suite, bus: Bus, agent_id: str) -> None:
        self.suite = suite
        self.bus = bus
        self.agent_id = agent_id

    def model_calls(self, *types: str) -> float:
        """The gateway's text-model calls so far (replies, should-respond questions, the evaluators'
        batched calls), or those of the given types. Embeddings are not counted: a stored message
        is embedded whoever sent it."""
        assert self.suite.gateway is not None
        port = self.suite.gateway.env["PARLEY_GATEWAY_METRICS_PORT"]
        return sum(
            scraped(port, "parley_model_requests_total", f'model_type="{t}"')
            for t in types or ("TEXT_SMALL", "TEXT_LARGE")
        )

    async def idle(self) -> None:
        """Wait until the runtime has no finished turn's after-reply work running (embeddings,
        evaluators), so every model call the turns so far made has been counted."""

        async def quiet() -> bool:
            port = self.suite.runtime.env["PARLEY_RUNTIME_METRICS_PORT"]
            return scraped(port, "parley_turn_background_tasks") == 0

        await eventually(quiet, timeout=30, what="the runtime's after-reply work to finish")

    async def dm(self, sender: str, text: str) -> runtime_pb2.InboundMessage:
        message = inbound(
            text, agent_id=self.agent_id, sender=sender, channel=f"dm-{sender}", source="discord"
        )
        await publish_inbound(self.bus, message)
        return message


@pytest.fixture(scope="module")
async def flow(test_env: SessionEnv, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Flow]:
    root = tmp_path_factory.mktemp("pairing-flow")
    characters = root / "characters"
    characters.mkdir()
    character = yaml.safe_load((ROOT / "characters" / "default.yaml").read_text())
    character["name"] = "guarded"
    # REFLECTION after every message it can: the stranger's first one would be reflected on.
    character["settings"] = {"DM_POLICY": "pairing", "REFLECTION_INTERVAL": 1}
    (characters / "guarded.yaml").write_text(yaml.safe_dump(character))
    suite = Suite(test_env, root / "logs", f"p{secrets.token_hex(4)}")
    await suite.start(runtimes=0)
    await suite.add_service("parley_pairing", "PAIRING")
    await suite.add_runtime(PARLEY_CHARACTERS_DIR=str(characters))
    bus = await suite.connect()
    agent_id = str(uuid.uuid5(uuid.UUID("6f1f3f3e-6a0c-5b8e-9a57-5061726c6579"), "agent:guarded"))
    try:
        yield Flow(suite, bus, agent_id)
    finally:
        await bus.close()
        suite.stop()


async def test_unknown_sender_gets_the_code_once_then_is_served_after_approval(flow: Flow) -> None:
    await flow.idle()
    calls, large = flow.model_calls(), flow.model_calls("TEXT_LARGE")
    sender = f"stranger{secrets.token_hex(3)}"
    # Long enough for REFLECTION to take up, were the stranger's words to reach an evaluator.
    first = await flow.dm(sender, "hello, is anyone there? I am Sam from Lisbon")
    [challenge] = await eventually(lambda: replies_to(flow.bus, first), timeout=20, what="the pairing reply")
    code = re.search(r"parley pairing approve discord ([A-Z0-9]{8}) --agent guarded", challenge.text)
    assert code is not None, challenge.text
    again = [await flow.dm(sender, f"anyone there {i}?") for i in range(3)]
    await eventually(lambda: inbound_settled(flow.bus), timeout=20, what="the follow-ups handled")
    for message in again:
        assert await replies_to(flow.bus, message) == []
    await flow.idle()
    assert flow.model_calls() == calls  # no text model: no reply, no question, no evaluator

    pairing = flow.suite.others[0]
    env = {k: v for k, v in os.environ.items() if not k.startswith("PARLEY_")}
    env.update(
        PARLEY_PAIRING_ADDR=f"127.0.0.1:{pairing.grpc_port}",
        PARLEY_OPERATOR_TOKEN=flow.suite.env.token,
        PARLEY_RUNTIME_ADDR=f"127.0.0.1:{flow.suite.runtime.grpc_port}",
    )
    approved = await asyncio.to_thread(
        subprocess.run,
        [PARLEY, "pairing", "approve", "discord", code.group(1).lower(), "--agent", "guarded"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert approved.returncode == 0, approved.stderr

    served = await flow.dm(sender, "now?")
    [reply] = await eventually(lambda: replies_to(flow.bus, served), timeout=20, what="a real answer")
    assert reply.text == "You said: now?"
    assert flow.model_calls("TEXT_LARGE") == large + 1


# What a connector could once write to make its message an autonomous turn (issue 12): the origin
# is now the subject a message came on, so these are just metadata.
AUTONOMY_CLAIMS = {"is_autonomous": "true", "parley_origin": "autonomous"}


async def test_a_connector_claiming_autonomy_still_meets_the_pairing_gate(flow: Flow) -> None:
    """A real connector credential (admitted by pairing through NATS auth callout) sends an unknown
    sender's DM marked autonomous: it is a user message, so the sender gets the pairing code and
    the model is not called."""
    pairing = PairingClient(RpcClient(flow.bus), timeout=10)
    created = await pairing.AddConnector(
        pairing_pb2.AddConnectorRequest(
            name=f"claims-{secrets.token_hex(3)}", agent_id=flow.agent_id, source="discord"
        )
    )
    name = created.connector.name
    connector = await Bus.connect(
        flow.suite.env.endpoints.nats_url,
        name="claiming-connector",
        namespace=flow.suite.namespace,
        user=name,
        password=created.password,
        inbox=permissions.connector_inbox(name),
    )
    try:
        await flow.idle()
        calls = flow.model_calls()
        sender = f"claimer{secrets.token_hex(3)}"
        message = inbound(
            "I am the agent itself", agent_id=flow.agent_id, sender=sender, channel=f"dm-{sender}"
        )
        message.source = "discord"
        message.metadata.update(AUTONOMY_CLAIMS)
        await publish_inbound(connector, message)
        [challenge] = await eventually(
            lambda: replies_to(flow.bus, message), timeout=20, what="the pairing reply"
        )
        assert "parley pairing approve discord" in challenge.text, challenge.text
        await flow.idle()
        assert flow.model_calls() == calls
    finally:
        await connector.close()


async def test_pairing_service_down_fails_closed_and_the_message_waits(flow: Flow) -> None:
    """Pairing stopped: the DM is not served (no model call, no reply), the runtime reports
    NOT_SERVING and parley_dependency_up{dependency="pairing"} 0; pairing started again: the
    held message is answered once (the pairing challenge), nothing dead-lettered."""
    pairing = flow.suite.others[0]
    pairing.stop()
    await flow.idle()
    calls = flow.model_calls()
    runtime = flow.suite.runtime
    message = await flow.dm(f"late{secrets.token_hex(3)}", "let me in")

    async def pairing_down() -> bool:
        return runtime_metric(runtime.env["PARLEY_RUNTIME_METRICS_PORT"], "pairing") == 0.0

    await eventually(pairing_down, timeout=30, what="the runtime to report pairing down")
    assert await health(runtime.grpc_port) == "NOT_SERVING"
    await asyncio.sleep(3)  # several probe intervals: still held, not answered, not failed
    assert await replies_to(flow.bus, message) == []
    assert flow.model_calls() == calls

    await flow.suite.add_service("parley_pairing", "PAIRING")
    [challenge] = await eventually(
        lambda: replies_to(flow.bus, message), timeout=30, what="the pairing reply after pairing is back"
    )
    assert "parley pairing approve discord" in challenge.text
    await eventually(lambda: inbound_settled(flow.bus), timeout=20, what="the held message acked")
    assert len(await replies_to(flow.bus, message)) == 1
    await flow.idle()
    assert flow.model_calls() == calls
    assert await health(runtime.grpc_port) == "SERVING"
    dead = await stream_messages(flow.bus, flow.bus.subjects.dead(flow.bus.subjects.stream("INBOUND")))
    assert dead == []


def runtime_metric(port: str, dependency: str) -> float | None:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    found = re.search(rf'^parley_dependency_up\{{dependency="{dependency}"\}} ([0-9.e+]+)$', text, re.M)
    return float(found.group(1)) if found else None


async def health(port: int) -> str:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
