"""Streamed calls over NATS (``parley_platform.rpcstream``) against a real server: items in order,
errors mid-stream, and every way a stream ends early reaching the handler as a cancellation (the
caller closes it or is cancelled, stops pinging, or its deadline passes); no responders; a request
without a stream id; concurrent streams kept apart."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import pytest
from nats.aio.msg import Msg

from parley.v1 import common_pb2
from parley.v1.model_pb2 import GenerateChunk, GenerateRequest
from parley_platform import frames, rpcstream
from parley_platform.bus import Bus
from parley_platform.errors import ParleyError, Unavailable
from parley_platform.rpc import RpcClient, RpcServer
from parley_platform.testing import eventually
from support import SessionEnv

Handler = Callable[[GenerateRequest], AsyncIterator[GenerateChunk]]


@dataclass
class Slow:
    """A handler that yields one item per ``delay`` and records how it ended."""

    delay: float = 0.1
    count: int = 100
    sent: int = 0
    cancelled: asyncio.Event = field(default_factory=asyncio.Event)

    async def __call__(self, request: GenerateRequest) -> AsyncIterator[GenerateChunk]:
        try:
            for i in range(self.count):
                await asyncio.sleep(self.delay)
                self.sent += 1
                yield GenerateChunk(text=f"{request.prompt}{i} ")
        except asyncio.CancelledError:
            self.cancelled.set()
            raise


@pytest.fixture
def service() -> str:
    return f"streamtest{uuid.uuid4().hex[:10]}"


@pytest.fixture
async def serve(bus: Bus, service: str) -> AsyncIterator[Callable[..., object]]:
    servers: list[RpcServer] = []

    async def start(handler: Handler, *, idle: float = 10.0) -> RpcServer:
        server = RpcServer(bus, service, stream_idle_seconds=idle)
        server.register_stream("GenerateStream", GenerateRequest, handler)
        await server.start()
        await bus.nc.flush()
        servers.append(server)
        return server

    yield start
    for server in servers:
        await server.stop(timeout=2)


def call(bus: Bus, service: str, prompt: str = "p", *, timeout: float = 10) -> AsyncIterator[GenerateChunk]:
    return RpcClient(bus).stream(
        service, "GenerateStream", GenerateRequest(prompt=prompt), GenerateChunk, timeout=timeout
    )


async def test_items_arrive_in_order_then_the_end(
    bus: Bus, service: str, serve: Callable[..., object]
) -> None:
    await serve(Slow(delay=0, count=50))  # type: ignore[operator]
    got = [c.text async for c in call(bus, service, "x")]
    assert got == [f"x{i} " for i in range(50)]


async def test_an_error_mid_stream_reaches_the_caller_after_the_items(
    bus: Bus, service: str, serve: Callable[..., object]
) -> None:
    async def failing(request: GenerateRequest) -> AsyncIterator[GenerateChunk]:
        yield GenerateChunk(text="one")
        yield GenerateChunk(text="two")
        raise Unavailable("provider went away", code="PROVIDER_DOWN", retryable=True)

    await serve(failing)  # type: ignore[operator]
    got: list[str] = []

    async def read() -> None:
        async for chunk in call(bus, service):
            got.append(chunk.text)

    with pytest.raises(ParleyError) as raised:
        await read()
    assert got == ["one", "two"]
    assert raised.value.code == "PROVIDER_DOWN"
    assert raised.value.retryable


async def test_a_crashing_handler_is_internal(bus: Bus, service: str, serve: Callable[..., object]) -> None:
    async def crashing(request: GenerateRequest) -> AsyncIterator[GenerateChunk]:
        yield GenerateChunk(text="one")
        raise RuntimeError("secret detail")

    await serve(crashing)  # type: ignore[operator]
    with pytest.raises(ParleyError) as raised:
        async for _ in call(bus, service):
            pass
    assert raised.value.code == "INTERNAL"
    assert "secret" not in raised.value.message


async def test_closing_the_stream_cancels_the_handler(
    bus: Bus, service: str, serve: Callable[..., object]
) -> None:
    slow = Slow()
    await serve(slow)  # type: ignore[operator]
    stream = call(bus, service)
    async for _ in stream:
        break
    await stream.aclose()  # type: ignore[attr-defined]
    async with asyncio.timeout(5):
        await slow.cancelled.wait()
    sent = slow.sent
    await asyncio.sleep(0.5)
    assert slow.sent == sent < slow.count  # it stopped


async def test_cancelling_the_callers_task_cancels_the_handler(
    bus: Bus, service: str, serve: Callable[..., object]
) -> None:
    slow = Slow()
    await serve(slow)  # type: ignore[operator]
    first = asyncio.Event()

    async def read() -> None:
        async for _ in call(bus, service):
            first.set()

    reader = asyncio.create_task(read())
    async with asyncio.timeout(5):
        await first.wait()
    reader.cancel()
    with pytest.raises(asyncio.CancelledError):
        await reader
    async with asyncio.timeout(5):
        await slow.cancelled.wait()


async def test_a_caller_that_stops_pinging_is_abandoned(
    bus: Bus, service: str, serve: Callable[..., object]
) -> None:
    slow = Slow(delay=0.05)
    await serve(slow, idle=0.5)  # type: ignore[operator]
    # A caller that vanished: the request went out, nobody pings or cancels.
    inbox = f"{bus.nc.new_inbox()}"
    sub = await bus.nc.subscribe(inbox)
    await bus.nc.publish(
        bus.subjects.rpc(service, "GenerateStream"),
        frames.request(
            GenerateRequest(prompt="p").SerializeToString(), deadline=None, stream_id=uuid.uuid4().hex
        ),
        reply=inbox,
    )
    async with asyncio.timeout(5):
        await slow.cancelled.wait()
    await sub.unsubscribe()
    assert slow.sent < slow.count


async def test_the_deadline_ends_the_stream_on_both_sides(
    bus: Bus, service: str, serve: Callable[..., object]
) -> None:
    slow = Slow(delay=0.1)
    await serve(slow)  # type: ignore[operator]
    with pytest.raises(ParleyError) as raised:
        async for _ in call(bus, service, timeout=0.6):
            pass
    assert raised.value.code == "DEADLINE_EXCEEDED"
    async with asyncio.timeout(5):
        await slow.cancelled.wait()


async def test_no_responders_fails_fast(bus: Bus, service: str) -> None:
    loop = asyncio.get_running_loop()
    started = loop.time()
    with pytest.raises(ParleyError) as raised:
        async for _ in call(bus, service, timeout=10):
            pass
    assert raised.value.code == "NO_RESPONDERS"
    assert loop.time() - started < 5


async def test_a_request_without_a_stream_id_is_refused(
    bus: Bus, service: str, serve: Callable[..., object]
) -> None:
    await serve(Slow(delay=0, count=1))  # type: ignore[operator]
    request = GenerateRequest(prompt="p").SerializeToString()
    reply = await bus.nc.request(
        bus.subjects.rpc(service, "GenerateStream"),
        frames.request(request, deadline=time.time() + 60),
        timeout=5,
    )
    status, body = frames.parse_reply(reply.data)
    assert status == frames.ERROR
    assert common_pb2.Error.FromString(body).code == "INVALID_ARGUMENT"
    # Nor is a request in no envelope at all taken: it says what it expected.
    reply = await bus.nc.request(bus.subjects.rpc(service, "GenerateStream"), request, timeout=5)
    status, body = frames.parse_reply(reply.data)
    assert status == frames.ERROR
    error = common_pb2.Error.FromString(body)
    assert error.code == "INVALID_PAYLOAD"
    assert "parley.v1.GenerateRequest" in error.message


async def test_concurrent_streams_do_not_cross(bus: Bus, service: str, serve: Callable[..., object]) -> None:
    await serve(Slow(delay=0.001, count=20))  # type: ignore[operator]

    async def one(n: int) -> list[str]:
        return [c.text async for c in call(bus, service, f"s{n}-")]

    results = await asyncio.gather(*(one(n) for n in range(40)))
    for n, got in enumerate(results):
        assert got == [f"s{n}-{i} " for i in range(20)]


async def test_streams_share_one_subscription_per_connection_and_cancels_find_their_replica(
    bus: Bus, service: str, test_env: SessionEnv
) -> None:
    """Two replicas serve on connections of their own; each hears every stream's control messages
    through one subscription and acts on its own streams only. The caller's 24 streams, each closed
    after three items, use one inbox subscription, and every route is gone once they are over."""
    replicas = [Slow(delay=0.05, count=1000), Slow(delay=0.05, count=1000)]
    connections = [
        await Bus.connect(test_env.nats_url, name="tests", namespace=bus.subjects.ns) for _ in replicas
    ]
    servers = []
    try:
        for connection, slow in zip(connections, replicas, strict=True):
            server = RpcServer(connection, service)
            server.register_stream("GenerateStream", GenerateRequest, slow)
            await server.start()
            await connection.nc.flush()
            servers.append(server)
        warm_up = call(bus, service, "w")
        await anext(warm_up)  # the caller's shared inbox subscription exists from here on
        await warm_up.aclose()  # type: ignore[attr-defined]
        subscriptions = len(bus.nc._subs)

        async def one(n: int) -> int:
            got = 0
            stream = call(bus, service, f"s{n}-")
            async for chunk in stream:
                assert chunk.text.startswith(f"s{n}-")
                got += 1
                if got == 3:
                    # nats-py's own table of this connection's subscriptions: no stream added one
                    assert len(bus.nc._subs) == subscriptions
                    break  # closed early: cancelled on whichever replica serves it
            await stream.aclose()  # type: ignore[attr-defined]
            return got

        assert await asyncio.gather(*(one(n) for n in range(24))) == [3] * 24
        assert all(not router.routes for router in rpcstream._routers[bus].values())

        async def all_stopped() -> bool:
            controls = [next(iter(rpcstream._routers[c].values())) for c in connections]
            return all(not r.routes for r in controls)

        await eventually(all_stopped, timeout=10, what="every replica's streams over")
        sent = [slow.sent for slow in replicas]
        await asyncio.sleep(0.3)
        assert [slow.sent for slow in replicas] == sent  # nothing still streams
        assert all(slow.cancelled.is_set() for slow in replicas)  # both served some, and were cancelled
    finally:
        for server in servers:
            await server.stop(timeout=2)
        for connection in connections:
            await connection.close()


@dataclass
class Burst:
    """A handler that yields ``count`` items of ``size`` characters without waiting (a model that
    answers at once), then optionally fails."""

    count: int
    size: int = 8
    fail: bool = False

    async def __call__(self, request: GenerateRequest) -> AsyncIterator[GenerateChunk]:
        for i in range(self.count):
            yield GenerateChunk(text=f"{i:0{self.size}d}")
        if self.fail:
            raise Unavailable("the provider went away", code="PROVIDER_UNAVAILABLE")


async def statuses_of_streams(bus: Bus, run: Callable[[], Awaitable[object]]) -> list[tuple[str, int]]:
    """(status, bytes) of every message that reached this connection's stream inboxes while
    ``run`` ran."""
    seen: list[tuple[str, int]] = []

    async def record(msg: Msg) -> None:
        status, body = frames.parse_reply(msg.data)
        seen.append((frames.STATUS_NAMES[status], len(body)))

    prefix = bus.nc.new_inbox().rsplit(".", 1)[0]
    sub = await bus.nc.subscribe(f"{prefix}.stream.*", cb=record)
    try:
        await bus.nc.flush()
        await run()
        await bus.nc.flush()
        await asyncio.sleep(0.1)
    finally:
        await sub.unsubscribe()
    return seen


async def raw_stream(bus: Bus, service: str, *, batch: bool) -> list[tuple[str, bytes]]:
    """(status, body) of every message of one streamed call made by hand with the envelope's
    ``BATCH`` flag or without it, and never ``LAST`` (a caller from before it), up to ``end``."""
    stream_id, inbox = rpcstream.stream_inbox(bus)
    received: asyncio.Queue[Msg] = asyncio.Queue()

    async def on_message(msg: Msg) -> None:
        received.put_nowait(msg)

    sub = await bus.nc.subscribe(inbox, cb=on_message)
    try:
        await bus.nc.publish(
            bus.subjects.rpc(service, "GenerateStream"),
            frames.request(
                GenerateRequest(prompt="p").SerializeToString(),
                deadline=time.time() + 60,
                stream_id=stream_id,
                batch=batch,
            ),
            reply=inbox,
        )
        seen: list[tuple[str, bytes]] = []
        async with asyncio.timeout(10):
            while not seen or seen[-1][0] != "end":
                status, body = frames.parse_reply((await received.get()).data)
                seen.append((frames.STATUS_NAMES[status], body))
        return seen
    finally:
        await sub.unsubscribe()


async def test_items_ready_together_travel_in_one_message(
    bus: Bus, service: str, serve: Callable[..., object]
) -> None:
    await serve(Burst(count=200))  # type: ignore[operator]
    got: list[str] = []

    async def read() -> None:
        got.extend([c.text async for c in call(bus, service)])

    seen = await statuses_of_streams(bus, read)
    assert got == [f"{i:08d}" for i in range(200)]
    # Ready at once: no "open", and the items come with the end (2 kB, one message).
    assert [status for status, _ in seen] == ["last"]


async def test_a_handler_that_waits_says_open_first_and_ends_with_its_last_items(
    bus: Bus, service: str, serve: Callable[..., object]
) -> None:
    await serve(Slow(delay=0.05, count=3))  # type: ignore[operator]
    got: list[str] = []

    async def read() -> None:
        got.extend([c.text async for c in call(bus, service, "w")])

    seen = await statuses_of_streams(bus, read)
    assert got == ["w0 ", "w1 ", "w2 "]
    statuses = [status for status, _ in seen]
    # Served, then each item as it comes; the last one is ready with the end (no sleep after it).
    assert statuses == ["open", "ok", "ok", "last"]
    assert seen[-1][1] > 0


async def test_a_batch_caller_without_last_still_gets_open_items_and_end(
    bus: Bus, service: str, serve: Callable[..., object]
) -> None:
    """A caller of before ``LAST`` (batches only) reads the stream as it always did."""
    await serve(Burst(count=30))  # type: ignore[operator]
    seen = await raw_stream(bus, service, batch=True)
    assert [status for status, _ in seen] == ["open", "items", "end"]
    items = [GenerateChunk.FromString(b).text for b in rpcstream._unframed(seen[1][1])]
    assert items == [f"{i:08d}" for i in range(30)]


async def test_a_large_burst_is_cut_into_batches_under_the_size_limit(
    bus: Bus, service: str, serve: Callable[..., object]
) -> None:
    await serve(Burst(count=120, size=2000))  # type: ignore[operator]
    got: list[str] = []

    async def read() -> None:
        got.extend([c.text async for c in call(bus, service)])

    seen = await statuses_of_streams(bus, read)
    assert got == [f"{i:02000d}" for i in range(120)]
    batches = [size for status, size in seen if status in ("items", "last")]
    assert len(batches) >= 3  # 240 kB of items
    assert max(batches) <= rpcstream.BATCH_BYTES
    assert [status for status, _ in seen][-1] == "last"


async def test_an_error_after_a_burst_comes_after_its_items(
    bus: Bus, service: str, serve: Callable[..., object]
) -> None:
    await serve(Burst(count=30, fail=True))  # type: ignore[operator]
    got: list[str] = []

    async def read() -> None:
        async for chunk in call(bus, service):
            got.append(chunk.text)

    with pytest.raises(ParleyError) as raised:
        await read()
    assert raised.value.code == "PROVIDER_UNAVAILABLE"
    assert got == [f"{i:08d}" for i in range(30)]


async def test_a_caller_that_does_not_take_batches_gets_one_item_per_message(
    bus: Bus, service: str, serve: Callable[..., object]
) -> None:
    """A caller that does not take batches (no ``BATCH`` flag) reads every item as ``ok``."""
    await serve(Burst(count=25))  # type: ignore[operator]
    seen = await raw_stream(bus, service, batch=False)
    assert [status for status, _ in seen] == ["open", *["ok"] * 25, "end"]
    assert [GenerateChunk.FromString(body).text for _, body in seen[1:-1]] == [f"{i:08d}" for i in range(25)]


def test_a_batch_that_runs_past_its_end_is_refused() -> None:
    framed = rpcstream._framed(b"abc") + rpcstream._framed(b"defg")
    assert list(rpcstream._unframed(framed)) == [b"abc", b"defg"]
    with pytest.raises(ValueError, match="past the end"):
        list(rpcstream._unframed(framed[:-1]))
