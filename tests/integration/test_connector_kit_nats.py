"""The connector kit on a nats-server of the test's own (no runtime, no auth).

Through an outage (the server stopped and started again, same port, same JetStream store): a
message sent while it is down is published once when it returns, and replies keep flowing to the
connector's consumer after it. Nothing serving the cancel subject is a clear error at once, not a
hang. A service connector (``agent_ids=None``) serves every agent of its source."""

from __future__ import annotations

import asyncio
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Iterator

import pytest

from parley.v1 import runtime_pb2
from parley_connectors import Connector, Inbound, Reply
from parley_devinfra.infra import EmbeddedNats
from parley_platform.bus import Bus
from parley_platform.errors import ParleyError

AGENT = str(uuid.uuid4())
SOURCE = "outage"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedNats]:
    """One server for the module (the outage test stops and starts it); each test its namespace."""
    root = tmp_path_factory.mktemp("nats")
    nats = EmbeddedNats(root / "js", log_file=root / "nats.log")
    nats.start()
    try:
        yield nats
    finally:
        nats.stop()


@pytest.fixture
async def connector(server: EmbeddedNats) -> AsyncIterator[Connector]:
    bus = await Bus.connect(server.url, name="outage-connector", namespace=f"o{secrets.token_hex(4)}")
    await bus.ensure_standard_streams()
    conn = await Connector(
        bus, source=SOURCE, agent_ids=[AGENT], durable="connector-outage", owns_bus=True
    ).start()
    try:
        yield conn
    finally:
        await conn.close()


def restart(server: EmbeddedNats) -> None:
    again = EmbeddedNats(server.store_dir, port=server.port, log_file=server.log_file)
    again.start()
    server.pid, server.monitor_port = again.pid, again.monitor_port


async def test_a_message_sent_during_an_outage_is_published_once_when_nats_returns(
    server: EmbeddedNats, connector: Connector
) -> None:
    replies: list[Reply] = []
    arrived = asyncio.Event()

    async def receive() -> None:
        async for reply in connector.replies(poll=1):
            replies.append(reply)
            arrived.set()
            await reply.ack()

    receiving = asyncio.create_task(receive())
    sent = Inbound(message_id="m-outage", sender_id="ann", text="are you up?")
    server.stop()
    sending = asyncio.create_task(connector.send(sent, retry_for=120))
    await asyncio.sleep(2)
    assert not sending.done()  # retrying, not lost, not failed
    with pytest.raises(ParleyError) as gave_up:
        await connector.send(Inbound(message_id="m-brief", sender_id="ann", text="x"), retry_for=1)
    assert gave_up.value.code == "SEND_GAVE_UP"
    await asyncio.to_thread(restart, server)
    assert await asyncio.wait_for(sending, 60) is True
    assert await connector.send(sent) is False  # the same message again: a duplicate

    observer = await Bus.connect(server.url, name="observer", namespace=connector.subjects.ns)
    try:
        stream = observer.subjects.stream("INBOUND")
        info = await observer.js.stream_info(stream)
        stored = [
            runtime_pb2.InboundMessage.FromString((await observer.js.get_msg(stream, seq)).data)
            for seq in range(1, info.state.last_seq + 1)
        ]
        # Once, whatever the retries; the message the connector gave up on may have gone out too
        # (the client flushes what it buffered when the server returns): sending it again is safe.
        assert [m.message_id for m in stored].count("m-outage") == 1
        assert {m.message_id for m in stored} <= {"m-outage", "m-brief"}
        assert all((m.agent_id, m.source) == (AGENT, SOURCE) for m in stored)
        # The runtime's answer (published here by hand) reaches the connector's consumer once.
        answer = runtime_pb2.OutboundMessage(
            agent_id=AGENT, source=SOURCE, response_id="r-1", in_reply_to="m-outage", text="yes"
        )
        subject = observer.subjects.outbound(AGENT, SOURCE)
        for _ in range(2):
            await observer.publish(subject, answer.SerializeToString(), msg_id="r-1")
    finally:
        await observer.close()
    await asyncio.wait_for(arrived.wait(), 30)
    await asyncio.sleep(2)  # and nothing more
    receiving.cancel()
    assert [(r.response_id, r.text) for r in replies] == [("r-1", "yes")]


async def test_cancel_with_nothing_serving_it_is_a_clear_error_at_once(connector: Connector) -> None:
    started = time.monotonic()
    with pytest.raises(ParleyError) as unserved:
        await connector.cancel(message_id="m1", timeout=10)
    assert unserved.value.code == "CANCEL_UNSERVED"
    assert time.monotonic() - started < 5
    with pytest.raises(ParleyError) as invalid:
        await connector.cancel()
    assert invalid.value.code == "INVALID_ARGUMENT"


async def test_a_service_connector_serves_every_agent_of_its_source(server: EmbeddedNats) -> None:
    """``agent_ids=None`` (the web connector): one consumer and one chunk subscription over every
    agent of the source; sending and cancelling name the agent."""
    ns = f"m{secrets.token_hex(4)}"
    bus = await Bus.connect(server.url, name="service-connector", namespace=ns)
    await bus.ensure_standard_streams()
    agents = [str(uuid.uuid4()), str(uuid.uuid4())]
    async with await Connector(
        bus, source="web", agent_ids=None, durable="web", owns_bus=True
    ).start() as web:
        assert web.outbound_filters() == [f"{ns}.outbound.*.web"]
        with pytest.raises(ParleyError) as unnamed:
            await web.send(Inbound(message_id="m0", sender_id="ann", text="which agent?"))
        assert unnamed.value.code == "INVALID_ARGUMENT"
        async with web.chunks() as chunks:
            for i, agent in enumerate(agents):
                assert await web.send(Inbound(message_id=f"m{i}", sender_id="ann", text="hi", agent_id=agent))
                answer = runtime_pb2.OutboundMessage(
                    agent_id=agent, source="web", response_id=f"r{i}", in_reply_to=f"m{i}", text=f"from {i}"
                )
                await bus.publish(
                    bus.subjects.outbound(agent, "web"), answer.SerializeToString(), msg_id=f"r{i}"
                )
                chunk = runtime_pb2.StreamChunk(agent_id=agent, source="web", response_id=f"r{i}", delta="x")
                await bus.publish_core(f"{ns}.stream.{agent}.web", chunk.SerializeToString())
            got = []
            async with asyncio.timeout(10):
                async for streamed in chunks:
                    got.append(streamed.agent_id)
                    if len(got) == 2:
                        break
            assert got == agents
        replies: list[Reply] = []
        async with asyncio.timeout(10):
            async for reply in web.replies(poll=1):
                replies.append(reply)
                await reply.ack()
                if len(replies) == 2:
                    break
        assert [(r.agent_id, r.text) for r in replies] == [(agents[0], "from 0"), (agents[1], "from 1")]
        stream = bus.subjects.stream("INBOUND")
        assert (await bus.js.stream_info(stream)).state.messages == 2


async def test_a_reply_answering_a_cancelled_iterator_goes_to_the_next_one_at_once(
    connector: Connector,
) -> None:
    """An iterator cancelled mid-fetch leaves its pull request on the server; the reply that answers
    it is not stuck until the consumer's ack_wait (30 s): the next iterator gets it."""
    waiting = asyncio.create_task(anext(aiter(connector.replies(poll=10))))
    await asyncio.sleep(0.5)  # its pull request (10 s) is on the server now
    waiting.cancel()
    answer = runtime_pb2.OutboundMessage(agent_id=AGENT, source=SOURCE, response_id="r-late", text="late")
    await connector.bus.publish(
        connector.bus.subjects.outbound(AGENT, SOURCE), answer.SerializeToString(), msg_id="r-late"
    )
    started = time.monotonic()
    async with asyncio.timeout(10):
        async for reply in connector.replies(poll=1):
            await reply.ack()
            break
    assert reply.response_id == "r-late"
    assert time.monotonic() - started < 5
