"""The NATS adapter against a real server: streams, consumers, deduplicated publish, errors."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import nats.errors
import pytest

from parley_devinfra.infra import free_port
from parley_platform.bus import Bus, ConsumerSpec, Inbox, StreamSpec
from parley_platform.errors import ParleyError, Unavailable
from support import SessionEnv


@pytest.fixture
async def stream(bus: Bus) -> AsyncIterator[StreamSpec]:
    """A stream of this test's own (not yet created), deleted afterwards."""
    tag = uuid.uuid4().hex[:12]
    spec = StreamSpec(
        name=f"{bus.subjects.ns.upper()}_BUSTEST_{tag.upper()}",
        subjects=[f"{bus.subjects.ns}.bustest.{tag}.>"],
        max_age_seconds=3600,
        duplicate_window_seconds=60,
    )
    yield spec
    with contextlib.suppress(Exception):
        await bus.js.delete_stream(spec.name)


async def test_ensure_stream_creates_then_leaves_alone_then_updates(bus: Bus, stream: StreamSpec) -> None:
    assert await bus.ensure_stream(stream) == "created"
    info = await bus.js.stream_info(stream.name)
    assert info.config.subjects == stream.subjects
    assert info.config.max_age == pytest.approx(3600)

    assert await bus.ensure_stream(stream) == "unchanged"

    longer = StreamSpec(
        name=stream.name,
        subjects=stream.subjects,
        max_age_seconds=7200,
        duplicate_window_seconds=stream.duplicate_window_seconds,
    )
    assert await bus.ensure_stream(longer) == "updated"
    live = await bus.js.stream_info(stream.name)
    assert live.config.max_age == pytest.approx(7200)
    assert await bus.ensure_stream(longer) == "unchanged"


async def test_ensure_stream_update_of_subjects_is_applied(bus: Bus, stream: StreamSpec) -> None:
    await bus.ensure_stream(stream)
    wider = StreamSpec(
        name=stream.name,
        subjects=[*stream.subjects, stream.subjects[0].replace(".>", "x.>")],
        max_age_seconds=stream.max_age_seconds,
        duplicate_window_seconds=stream.duplicate_window_seconds,
    )
    assert await bus.ensure_stream(wider) == "updated"
    live = await bus.js.stream_info(stream.name)
    assert sorted(live.config.subjects or []) == sorted(wider.subjects)


async def test_ensure_stream_rejected_update_is_a_parley_error(bus: Bus, stream: StreamSpec) -> None:
    await bus.ensure_stream(stream)
    # The server refuses a duplicate window longer than max_age: the refusal must be translated.
    bad = StreamSpec(
        name=stream.name, subjects=stream.subjects, max_age_seconds=10, duplicate_window_seconds=60
    )
    with pytest.raises(ParleyError) as caught:
        await bus.ensure_stream(bad)
    assert not isinstance(caught.value, nats.errors.Error)
    assert caught.value.code == "NATS_ERROR"


async def test_ensure_consumer_is_idempotent_and_applies_changes(bus: Bus, stream: StreamSpec) -> None:
    await bus.ensure_stream(stream)
    spec = ConsumerSpec(
        stream=stream.name,
        durable=f"c_{uuid.uuid4().hex[:8]}",
        filter_subject=stream.subjects[0],
        ack_wait_seconds=7,
        max_deliver=4,
    )
    assert await bus.ensure_consumer(spec) == "created"
    assert await bus.ensure_consumer(spec) == "unchanged"
    assert await bus.ensure_consumer(spec) == "unchanged"
    info = await bus.js.consumer_info(stream.name, spec.durable)
    assert info.config.max_deliver == 4
    assert info.config.ack_wait == pytest.approx(7)

    changed = ConsumerSpec(
        stream=spec.stream,
        durable=spec.durable,
        filter_subject=spec.filter_subject,
        ack_wait_seconds=spec.ack_wait_seconds,
        max_deliver=6,
    )
    assert await bus.ensure_consumer(changed) == "updated"
    info = await bus.js.consumer_info(stream.name, spec.durable)
    assert info.config.max_deliver == 6
    assert await bus.ensure_consumer(changed) == "unchanged"


async def test_publish_deduplicates_by_msg_id(bus: Bus, stream: StreamSpec) -> None:
    await bus.ensure_stream(stream)
    subject = stream.subjects[0].replace(">", "dedup")
    msg_id = f"m-{uuid.uuid4().hex}"
    assert await bus.publish(subject, b"first", msg_id=msg_id, headers={"X-Test": "1"}) is True
    assert await bus.publish(subject, b"second", msg_id=msg_id) is False
    assert await bus.publish(subject, b"other", msg_id=f"{msg_id}-2") is True
    assert await bus.publish(subject, b"no id") is True
    assert await bus.publish(subject, b"no id") is True

    info = await bus.js.stream_info(stream.name)
    assert info.state.messages == 4
    first = await bus.js.get_msg(stream.name, 1)
    assert first.data == b"first"
    assert first.headers is not None
    assert first.headers["X-Test"] == "1"
    assert first.headers["Nats-Msg-Id"] == msg_id


async def test_publish_to_subject_without_stream_is_a_parley_error(bus: Bus) -> None:
    subject = f"{bus.subjects.ns}.nostream.{uuid.uuid4().hex}"
    with pytest.raises(ParleyError) as caught:
        await bus.publish(subject, b"x", timeout=2)
    assert not isinstance(caught.value, nats.errors.Error)


async def test_connect_to_a_dead_port_fails_fast_with_unavailable(test_env: SessionEnv) -> None:
    url = f"nats://127.0.0.1:{free_port()}"
    started = time.monotonic()
    with pytest.raises(Unavailable) as caught:
        async with asyncio.timeout(10):
            await Bus.connect(url, name="dead", namespace=test_env.namespace, connect_timeout=1.0)
    assert caught.value.code == "NATS_UNAVAILABLE"
    assert url in caught.value.message
    assert time.monotonic() - started < 5


async def test_connect_redacts_credentials(test_env: SessionEnv) -> None:
    url = f"nats://user:s3cret@127.0.0.1:{free_port()}"
    with pytest.raises(Unavailable) as caught:
        async with asyncio.timeout(10):
            await Bus.connect(url, name="dead", namespace=test_env.namespace, connect_timeout=1.0)
    assert "s3cret" not in str(caught.value)


async def test_close_is_idempotent_and_publishing_after_close_is_unavailable(test_env: SessionEnv) -> None:
    own = await Bus.connect(test_env.nats_url, name="closing", namespace=test_env.namespace)
    await own.close()
    await own.close()
    with pytest.raises(Unavailable):
        await own.publish_core(f"{test_env.namespace}.closed", b"x")


async def test_an_inbox_routes_each_reply_to_its_own_request(bus: Bus) -> None:
    """200 requests in flight on one inbox, answered in the reverse order: each gets its own."""
    subject = f"{bus.subjects.ns}.inboxtest.{uuid.uuid4().hex}"
    held: list[Any] = []
    all_in = asyncio.Event()

    async def answer_backwards(msg: Any) -> None:
        held.append(msg)
        if len(held) == 200:
            all_in.set()

    sub = await bus.nc.subscribe(subject, cb=answer_backwards)
    inbox = Inbox(bus)
    await inbox.start()
    try:
        futures = [await inbox.request(subject, str(i).encode()) for i in range(200)]
        await asyncio.wait_for(all_in.wait(), 10)
        for msg in reversed(held):
            await msg.respond(b"re:" + msg.data)
        replies = await asyncio.wait_for(asyncio.gather(*futures), 10)
        assert [r.data for r in replies] == [f"re:{i}".encode() for i in range(200)]
        assert len(inbox) == 0
    finally:
        await sub.unsubscribe()
        await inbox.close()


async def test_an_inbox_request_nobody_serves_fails_as_no_responders(bus: Bus) -> None:
    inbox = Inbox(bus)
    await inbox.start()
    try:
        future = await inbox.request(f"{bus.subjects.ns}.inboxtest.nobody.{uuid.uuid4().hex}", b"x")
        with pytest.raises(ParleyError) as raised:
            await asyncio.wait_for(future, 10)
        assert raised.value.code == "NO_RESPONDERS"
        assert len(inbox) == 0
    finally:
        await inbox.close()


async def test_an_inbox_drops_a_reply_its_caller_gave_up_on_and_fails_those_left_at_close(bus: Bus) -> None:
    subject = f"{bus.subjects.ns}.inboxtest.{uuid.uuid4().hex}"
    received: asyncio.Queue[Any] = asyncio.Queue()

    async def hold(msg: Any) -> None:
        await received.put(msg)

    sub = await bus.nc.subscribe(subject, cb=hold)
    inbox = Inbox(bus)
    await inbox.start()
    try:
        given_up = await inbox.request(subject, b"late")
        waiting = await inbox.request(subject, b"never answered")
        late = await asyncio.wait_for(received.get(), 10)
        await asyncio.wait_for(received.get(), 10)  # the one never answered
        given_up.cancel()
        await asyncio.sleep(0)  # a future's done callbacks run on the loop's next turn
        assert len(inbox) == 1
        await late.respond(b"too late")
        # Replies come to the inbox in order: once a later one is in, the late one was handled.
        probe = await inbox.request(subject, b"probe")
        await (await asyncio.wait_for(received.get(), 10)).respond(b"probe answered")
        assert (await asyncio.wait_for(probe, 10)).data == b"probe answered"
        assert not waiting.done()  # the late reply went to nobody, not to another request
        assert len(inbox) == 1
    finally:
        await sub.unsubscribe()
        await inbox.close()
    with pytest.raises(Unavailable):
        await waiting
    assert len(inbox) == 0


async def test_an_inbox_request_that_cannot_be_sent_fails_as_unavailable_and_leaves_nothing(
    test_env: SessionEnv,
) -> None:
    own = await Bus.connect(test_env.nats_url, name="inbox-closing", namespace=test_env.namespace)
    inbox = Inbox(own)
    await inbox.start()
    await own.nc.close()
    with pytest.raises(Unavailable):
        await inbox.request(f"{test_env.namespace}.inboxtest.closed", b"x")
    assert len(inbox) == 0
