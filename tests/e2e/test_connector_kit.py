"""The connector kit (libs/connectors) against the real suite: a real NATS server with auth, the
pairing service admitting the connector's own identity, the runtime answering through the scripted
model. A connector's messages are deduplicated by their platform id; replies produced while it is
stopped wait in its durable consumer and come once when it returns; it is refused what its
identity may not do; a malformed reply is terminated, not a crash."""

from __future__ import annotations

import asyncio
import json
import secrets
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from parley.v1 import pairing_pb2, runtime_pb2
from parley.v1.pairing_nats import PairingClient
from parley_cli.connectors_commands import credentials
from parley_connectors import Connector, Credentials, Inbound, Reply
from parley_platform.bus import Bus
from parley_platform.errors import ParleyError
from parley_platform.rpc import RpcClient
from parley_platform.testing import eventually
from support import DEFAULT_AGENT_ID, ROOT, SessionEnv, Suite, inbound_settled, replies_to

SOURCE = "kit"
EXAMPLE = ROOT / "examples" / "connectors" / "jsonl_connector.py"


@dataclass
class Kit:
    suite: Suite
    operator: Bus
    pairing: PairingClient
    root: Path

    async def credentials(self, source: str = "", agent_id: str = DEFAULT_AGENT_ID) -> Credentials:
        """A new connector (for a source of its own unless given), its credentials written by
        `parley connectors add`'s own code and loaded."""
        source = source or f"{SOURCE}{secrets.token_hex(3)}"
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


async def collect(conn: Connector, count: int, timeout: float = 30, *, ack: bool = True) -> list[Reply]:
    """``count`` replies, acknowledged; with ``count`` 0, whatever comes within ``timeout``."""
    found: list[Reply] = []

    async def gather() -> None:
        async for reply in conn.replies(poll=1):
            found.append(reply)
            if ack:
                await reply.ack()
            if len(found) == count:
                return

    try:
        await asyncio.wait_for(gather(), timeout)
    except TimeoutError:
        if count:
            raise
    return found


def wire(conn_creds: Credentials, sent: Inbound) -> runtime_pb2.InboundMessage:
    return sent.to_proto(conn_creds.agent_id, conn_creds.source)


async def answered(kit: Kit, creds: Credentials, sent: list[Inbound]) -> None:
    """Every message in ``sent`` has its reply in the OUTBOUND stream."""

    async def done() -> bool:
        return all([await replies_to(kit.operator, wire(creds, m)) for m in sent])

    await eventually(done, timeout=60, what="the replies produced")


async def test_a_message_sent_through_the_kit_is_answered_through_its_durable_consumer(kit: Kit) -> None:
    creds = await kit.credentials()
    async with await Connector.connect(creds) as conn:
        sent = message("hello kit")
        assert await conn.send(sent) is True
        [reply] = await collect(conn, 1)
    assert reply.text == "You said: hello kit"
    assert (reply.in_reply_to, reply.channel_id, reply.source) == (
        sent.message_id,
        sent.channel_id,
        creds.source,
    )
    assert reply.deliveries == 1
    await eventually(lambda: inbound_settled(kit.operator), timeout=20, what="the inbound handled")


async def test_the_same_message_id_is_one_message_and_one_answer(kit: Kit) -> None:
    """A platform delivering a message twice, even by two connections racing: one publish is new,
    the others are JetStream duplicates, and the agent answers once."""
    creds = await kit.credentials()
    first, second = await Connector.connect(creds), await Connector.connect(creds)
    try:
        sent = message("say it once")
        results = await asyncio.gather(first.send(sent), second.send(sent), first.send(sent))
        assert sorted(results) == [False, False, True]
        await answered(kit, creds, [sent])
        await eventually(lambda: inbound_settled(kit.operator), timeout=20, what="the inbound handled")
        assert len(await replies_to(kit.operator, wire(creds, sent))) == 1
        [reply] = await collect(first, 1)
        assert reply.in_reply_to == sent.message_id
        assert await collect(second, 0, timeout=3) == []
    finally:
        await first.close()
        await second.close()


async def test_a_connector_restarted_before_publishing_its_message_yields_one_answer(kit: Kit) -> None:
    """The connector publishes a platform message, dies before telling the platform (its connection
    cut, no drain), and the restarted connector gets the same message again and publishes it: the
    agent answers once, and the restarted connector receives that one answer."""
    creds = await kit.credentials()
    sent = message("are you there?")
    dying = await Connector.connect(creds)
    assert await dying.send(sent) is True
    await dying.bus.nc.close()  # a crash: no drain, nothing more from this process
    async with await Connector.connect(creds) as restarted:
        assert await restarted.send(sent) is False
        [reply] = await collect(restarted, 1)
        assert reply.in_reply_to == sent.message_id
        assert reply.text == "You said: are you there?"
        assert await collect(restarted, 0, timeout=3) == []
    assert len(await replies_to(kit.operator, wire(creds, sent))) == 1


async def test_replies_produced_while_the_connector_is_stopped_come_once_when_it_returns(kit: Kit) -> None:
    creds = await kit.credentials()
    await (await Connector.connect(creds)).close()  # its durable consumer exists from now on
    sent = [message(f"while you were away {i}") for i in range(6)]
    for m in sent:  # the platform's messages still arrive (another replica of the connector)
        data = wire(creds, m).SerializeToString()
        await kit.operator.publish(creds.inbound_subject, data, msg_id=f"{creds.source}:{m.message_id}")
    await answered(kit, creds, sent)
    async with await Connector.connect(creds) as back:
        got = await collect(back, len(sent))
        assert await collect(back, 0, timeout=3) == []
    assert sorted(r.in_reply_to for r in got) == sorted(m.message_id for m in sent)
    assert all(r.deliveries == 1 for r in got)
    async with await Connector.connect(creds) as again:  # acknowledged: never again
        assert await collect(again, 0, timeout=3) == []


async def test_a_reply_not_acknowledged_comes_again_until_it_is(kit: Kit) -> None:
    creds = await kit.credentials()
    async with await Connector.connect(creds, ack_wait=2.0) as conn:
        sent = message("ack me")
        await conn.send(sent)
        [unhandled] = await collect(conn, 1, ack=False)
    async with await Connector.connect(creds) as back:
        [again] = await collect(back, 1)
        assert await collect(back, 0, timeout=4) == []
    assert (again.response_id, again.deliveries) == (unhandled.response_id, 2)


async def test_the_kit_is_refused_what_the_connector_may_not_do(kit: Kit) -> None:
    creds = await kit.credentials()
    other_agent = str(uuid.uuid4())
    # Another agent's replies, another source's replies: the consumer cannot be created.
    with pytest.raises(ParleyError) as refused:
        await Connector.connect(creds, agent_ids=[other_agent])
    assert refused.value.code == "NATS_PERMISSION_DENIED"
    async with await Connector.connect(creds) as conn:
        other_source = Connector(
            conn.bus, source="elsewhere", agent_ids=[creds.agent_id], durable=creds.durable
        )
        with pytest.raises(ParleyError) as refused:
            await other_source.start()
        assert refused.value.code == "NATS_PERMISSION_DENIED"
        # Another agent's inbound, another source's inbound: the publish is refused, not retried.
        anywhere = Connector(
            conn.bus, source=creds.source, agent_ids=None, durable=creds.durable, publish_timeout=1
        )
        with pytest.raises(ParleyError) as refused:
            await anywhere.send(Inbound(message_id="x1", sender_id="eve", text="hi", agent_id=other_agent))
        assert refused.value.code == "NATS_PERMISSION_DENIED"
        with pytest.raises(ParleyError) as refused:
            await other_source.send(message("not mine"))
        assert refused.value.code == "NATS_PERMISSION_DENIED"
        # Its own still works on the same connection.
        sent = message("still mine")
        assert await conn.send(sent) is True
        [reply] = await collect(conn, 1)
        assert reply.in_reply_to == sent.message_id


async def test_a_malformed_reply_is_terminated_and_logged_not_a_crash(
    kit: Kit, caplog: pytest.LogCaptureFixture
) -> None:
    creds = await kit.credentials()
    async with await Connector.connect(creds) as conn:
        for i, junk in enumerate([b"\xff\xff\xff\xff", b'{"text": "json, not protobuf"}', b""]):
            await kit.operator.publish(creds.outbound_subject, junk, msg_id=f"junk-{i}")
        sent = message("after the junk")
        await conn.send(sent)
        with caplog.at_level("WARNING"):
            [reply] = await collect(conn, 1)
        assert reply.in_reply_to == sent.message_id

        async def settled() -> bool:  # the junk terminated and the reply acknowledged, nothing left
            info = await kit.operator.js.consumer_info(creds.outbound_stream, creds.durable)
            return (info.num_pending, info.num_ack_pending) == (0, 0)

        await eventually(settled, timeout=10, what="the consumer settled")
    assert sum("malformed reply terminated" in r.getMessage() for r in caplog.records) == 3


async def test_stream_chunks_arrive_decoded_and_a_malformed_one_is_skipped(kit: Kit) -> None:
    creds = await kit.credentials()
    async with await Connector.connect(creds) as conn, conn.chunks() as chunks:
        await kit.operator.publish_core(creds.stream_subject, b"\xff\xff")
        for sequence, (delta, final) in enumerate([("Hel", False), ("lo", False), ("", True)], start=1):
            chunk = runtime_pb2.StreamChunk(
                agent_id=creds.agent_id,
                source=creds.source,
                turn_id="t1",
                response_id="r1",
                in_reply_to="m1",
                sequence=sequence,
                delta=delta,
                final=final,
                outcome="completed" if final else "",
            )
            await kit.operator.publish_core(creds.stream_subject, chunk.SerializeToString())
        got = []
        async with asyncio.timeout(10):
            async for chunk in chunks:
                got.append(chunk)
                if chunk.final:
                    break
    assert "".join(c.delta for c in got) == "Hello"
    assert [c.sequence for c in got] == [1, 2, 3]
    assert (got[-1].outcome, got[-1].response_id, got[-1].turn_id) == ("completed", "r1", "t1")


async def test_the_example_connector_answers_each_platform_message_once(kit: Kit) -> None:
    """examples/connectors/jsonl_connector.py (docs/connectors.md) as a process: a line in, a reply
    line out; the platform delivering a message twice still gets one reply."""
    creds = await kit.credentials()
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        str(EXAMPLE),
        str(kit.root / f"{creds.name}.json"),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    stdin, stdout = process.stdin, process.stdout
    assert stdin is not None
    assert stdout is not None
    try:

        async def line(event: dict[str, str]) -> None:
            stdin.write(json.dumps(event).encode() + b"\n")
            await stdin.drain()

        async def reply() -> dict[str, str]:
            return dict(json.loads(await asyncio.wait_for(stdout.readline(), 60)))

        chat = f"c-{secrets.token_hex(3)}"
        first = {"id": f"p-{secrets.token_hex(4)}", "user": "ann", "chat": chat, "text": "hello example"}
        await line(first)
        assert await reply() == {"chat": chat, "reply_to": first["id"], "text": "You said: hello example"}
        await line(first)  # the platform delivers it again
        second = {**first, "id": f"p-{secrets.token_hex(4)}", "text": "and again"}
        await line(second)
        assert await reply() == {"chat": chat, "reply_to": second["id"], "text": "You said: and again"}
    finally:
        process.terminate()
        await process.wait()
    sent = Inbound(message_id=first["id"], sender_id="ann", text="", channel_id=chat)
    assert len(await replies_to(kit.operator, wire(creds, sent))) == 1
