"""The connector kit (libs/connectors) against the real suite: a real NATS server with auth, the
pairing service admitting the connector's own identity, the runtime answering through the scripted
model. A connector's messages are deduplicated by their platform id; replies produced while it is
stopped wait in its durable consumer and come once when it returns; it is refused what its
identity may not do; a malformed reply is terminated, not a crash."""

from __future__ import annotations

import asyncio
import json
import secrets
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from parley.v1 import pairing_pb2
from parley.v1.pairing_nats import PairingClient
from parley_cli.connectors_commands import credentials
from parley_connectors import Connector, Credentials, Inbound, Reply
from parley_platform.bus import Bus
from parley_platform.rpc import RpcClient
from parley_platform.testing import eventually
from support import DEFAULT_AGENT_ID, SessionEnv, Suite, inbound_settled

SOURCE = "kit"


@dataclass
class Kit:
    suite: Suite
    operator: Bus
    pairing: PairingClient
    root: Path

    async def credentials(self, source: str = SOURCE, agent_id: str = DEFAULT_AGENT_ID) -> Credentials:
        """A new connector, its credentials written by `parley connectors add`'s own code and loaded."""
        created = await self.pairing.AddConnector(
            pairing_pb2.AddConnectorRequest(
                name=f"kit-{secrets.token_hex(4)}", agent_id=agent_id, source=source
            )
        )
        path = self.root / f"{created.connector.name}.json"
        path.write_text(json.dumps(credentials(created, self.suite.env.endpoints.nats_url)))
        return Credentials.load(path)


@pytest.fixture(scope="module")
async def kit(test_env: SessionEnv, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Kit]:
    root = tmp_path_factory.mktemp("kit")
    suite = Suite(test_env, root, f"k{secrets.token_hex(4)}")
    try:
        await suite.start(runtimes=1)
        await suite.add_service("parley_pairing", "PAIRING")
        operator = await suite.connect()
        try:
            yield Kit(suite, operator, PairingClient(RpcClient(operator), timeout=10), root)
        finally:
            await operator.close()
    finally:
        suite.stop()


def message(text: str, message_id: str | None = None) -> Inbound:
    return Inbound(
        message_id=message_id or uuid.uuid4().hex,
        sender_id="ann",
        sender_name="Ann",
        channel_id=f"kit-{uuid.uuid4().hex[:8]}",
        text=text,
        room_type="dm",
    )


async def collect(conn: Connector, count: int, timeout: float = 30) -> list[Reply]:
    found: list[Reply] = []

    async def gather() -> None:
        async for reply in conn.replies(poll=1):
            found.append(reply)
            await reply.ack()
            if len(found) == count:
                return

    await asyncio.wait_for(gather(), timeout)
    return found


async def test_a_message_sent_through_the_kit_is_answered_through_its_durable_consumer(kit: Kit) -> None:
    creds = await kit.credentials()
    async with await Connector.connect(creds) as conn:
        sent = message("hello kit")
        assert await conn.send(sent) is True
        [reply] = await collect(conn, 1)
    assert reply.text == "You said: hello kit"
    assert (reply.in_reply_to, reply.channel_id, reply.source) == (sent.message_id, sent.channel_id, SOURCE)
    assert reply.deliveries == 1
    await eventually(lambda: inbound_settled(kit.operator), timeout=20, what="the inbound handled")
