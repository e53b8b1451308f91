"""NATS request/reply with the protobuf contract against a real server: replies, the error
envelope, undecodable requests, crashes, deadlines, no responders, queue groups."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from parley.v1 import common_pb2
from parley.v1.model_pb2 import GenerateRequest, GenerateResponse
from parley_platform import frames
from parley_platform.bus import Bus
from parley_platform.errors import (
    Conflict,
    DeadlineExceeded,
    FailedPrecondition,
    Internal,
    InvalidArgument,
    Kind,
    NotFound,
    ParleyError,
    PermissionDenied,
    ResourceExhausted,
    Unauthenticated,
    Unavailable,
)
from parley_platform.rpc import RpcClient, RpcServer
from parley_platform.testing import eventually
from support import SessionEnv

Handler = Callable[[GenerateRequest], Awaitable[GenerateResponse]]


@pytest.fixture
def service() -> str:
    return f"rpctest{uuid.uuid4().hex[:10]}"


@pytest.fixture
async def serve(bus: Bus, service: str) -> AsyncIterator[Callable[[Handler], Awaitable[RpcServer]]]:
    servers: list[RpcServer] = []

    async def start(handler: Handler) -> RpcServer:
        server = RpcServer(bus, service)
        server.register("Generate", GenerateRequest, handler)
        await server.start()
        await bus.nc.flush()
        servers.append(server)
        return server

    yield start
    for server in servers:
        await server.stop(timeout=2)


async def echo(request: GenerateRequest) -> GenerateResponse:
    return GenerateResponse(text=request.prompt[::-1], provider="echo", model=request.agent_id)


async def test_round_trip(bus: Bus, service: str, serve: Callable[[Handler], Awaitable[RpcServer]]) -> None:
    await serve(echo)
    reply = await RpcClient(bus).call(
        service, "Generate", GenerateRequest(agent_id="a1", prompt="hello"), GenerateResponse, timeout=5
    )
    assert reply == GenerateResponse(text="olleh", provider="echo", model="a1")


ERRORS: list[ParleyError] = [
    InvalidArgument("prompt is empty", code="EMPTY_PROMPT", hint="send some text"),
    NotFound("no agent a1", code="AGENT_NOT_FOUND"),
    Conflict("version moved", code="CAS_FAILED", hint="reload and retry", retryable=True),
    FailedPrecondition("agent disabled", code="AGENT_DISABLED"),
    ResourceExhausted("too many turns", code="RATE_LIMITED", hint="slow down"),
    Unauthenticated("who are you"),
    PermissionDenied("not yours", code="NOT_OWNER"),
    Unavailable("provider down", code="PROVIDER_DOWN", retryable=False),
    DeadlineExceeded("model too slow", code="MODEL_TIMEOUT"),
    Internal("broken invariant", code="INVARIANT"),
]


async def test_every_error_kind_round_trips(
    bus: Bus, service: str, serve: Callable[[Handler], Awaitable[RpcServer]]
) -> None:
    by_code = {err.code: err for err in ERRORS}

    async def failing(request: GenerateRequest) -> GenerateResponse:
        raise by_code[request.prompt]

    await serve(failing)
    client = RpcClient(bus)
    assert {err.kind for err in ERRORS} == set(Kind)
    for sent in ERRORS:
        with pytest.raises(ParleyError) as caught:
            await client.call(service, "Generate", GenerateRequest(prompt=sent.code), GenerateResponse)
        got = caught.value
        assert type(got) is type(sent)
        assert (got.kind, got.code, got.message, got.hint, got.retryable) == (
            sent.kind,
            sent.code,
            sent.message,
            sent.hint,
            sent.retryable,
        )


async def test_undecodable_request_is_invalid_payload(
    bus: Bus, service: str, serve: Callable[[Handler], Awaitable[RpcServer]]
) -> None:
    calls: list[GenerateRequest] = []

    async def handler(request: GenerateRequest) -> GenerateResponse:
        calls.append(request)
        return GenerateResponse()

    await serve(handler)
    subject = bus.subjects.rpc(service, "Generate")
    # A truncated length-delimited field: no protobuf parser accepts it. Each in the envelope, and
    # the bytes alone, which are in no envelope (nor is a request of another protocol, or nothing).
    bodies = (b"\x1a\x05ab", b"\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff", b"\x1a\x02\xc3\x28")
    unframed = [*bodies, b"", GenerateRequest(prompt="no envelope").SerializeToString()]
    framed = [frames.request(body, deadline=None) for body in bodies]
    for garbage in [*framed, *unframed]:
        reply = await bus.nc.request(subject, garbage, timeout=5)
        status, body = frames.parse_reply(reply.data)
        assert status == frames.ERROR
        envelope = common_pb2.Error.FromString(body)
        assert envelope.code == "INVALID_PAYLOAD"
        assert envelope.kind == common_pb2.ERROR_KIND_INVALID_ARGUMENT
        assert "parley.v1.GenerateRequest" in envelope.message
        assert ("envelope" in envelope.message) == (garbage in unframed), envelope.message
    assert calls == []


async def test_handler_crash_is_internal_without_the_exception_text(
    bus: Bus, service: str, serve: Callable[[Handler], Awaitable[RpcServer]]
) -> None:
    async def crash(request: GenerateRequest) -> GenerateResponse:
        raise RuntimeError("password=hunter2 in a stack trace")

    await serve(crash)
    for _ in range(2):  # the second call proves the server survived the first crash
        with pytest.raises(Internal) as caught:
            await RpcClient(bus).call(service, "Generate", GenerateRequest(prompt="x"), GenerateResponse)
        err = caught.value
        assert err.code == "INTERNAL"
        assert "hunter2" not in f"{err.message} {err.hint}"
        assert "RuntimeError" not in err.message


async def test_caller_deadline_bounds_the_handler(
    bus: Bus, service: str, serve: Callable[[Handler], Awaitable[RpcServer]]
) -> None:
    cancelled: list[str] = []

    async def slow(request: GenerateRequest) -> GenerateResponse:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.append(request.prompt)
            raise
        raise AssertionError("unreachable")

    await serve(slow)
    started = time.monotonic()
    with pytest.raises(DeadlineExceeded) as caught:
        await RpcClient(bus).call(
            service, "Generate", GenerateRequest(prompt="a"), GenerateResponse, timeout=0.3
        )
    assert time.monotonic() - started < 3
    assert caught.value.retryable

    async def handler_cancelled() -> bool:
        return cancelled == ["a"]

    await eventually(handler_cancelled, timeout=5, what="handler cancelled at the caller's deadline")

    # The server enforces the propagated deadline itself, and says so in the envelope.
    subject = bus.subjects.rpc(service, "Generate")
    data = frames.request(GenerateRequest(prompt="b").SerializeToString(), deadline=time.time() + 0.3)
    reply = await bus.nc.request(subject, data, timeout=5)
    status, body = frames.parse_reply(reply.data)
    assert status == frames.ERROR
    envelope = common_pb2.Error.FromString(body)
    assert (envelope.kind, envelope.code) == (common_pb2.ERROR_KIND_DEADLINE_EXCEEDED, "DEADLINE_EXCEEDED")
    assert cancelled == ["a", "b"]


async def test_each_request_is_bounded_by_its_own_deadline(
    bus: Bus, service: str, serve: Callable[[Handler], Awaitable[RpcServer]]
) -> None:
    """Forty requests in flight on one server: the twenty with a short deadline are cancelled and
    answered DEADLINE_EXCEEDED, the twenty with a long one run to the end and are answered."""
    release = asyncio.Event()
    cancelled: list[str] = []

    async def held(request: GenerateRequest) -> GenerateResponse:
        try:
            await release.wait()
        except asyncio.CancelledError:
            cancelled.append(request.prompt)
            raise
        return GenerateResponse(text=request.prompt)

    await serve(held)
    subject = bus.subjects.rpc(service, "Generate")

    async def call(prompt: str, deadline: float) -> tuple[int, bytes]:
        data = frames.request(
            GenerateRequest(prompt=prompt).SerializeToString(), deadline=time.time() + deadline
        )
        reply = await bus.nc.request(subject, data, timeout=10)
        return frames.parse_reply(reply.data)

    short = [asyncio.create_task(call(f"short-{i}", 0.3)) for i in range(20)]
    long = [asyncio.create_task(call(f"long-{i}", 8)) for i in range(20)]
    started = time.monotonic()
    for status, body in await asyncio.gather(*short):
        assert status == frames.ERROR
        assert common_pb2.Error.FromString(body).code == "DEADLINE_EXCEEDED"
    assert time.monotonic() - started < 2
    assert sorted(cancelled) == sorted(f"short-{i}" for i in range(20))
    release.set()
    answers = await asyncio.gather(*long)
    assert {GenerateResponse.FromString(body).text for status, body in answers if status == frames.OK} == {
        f"long-{i}" for i in range(20)
    }
    assert len(cancelled) == 20


async def test_a_handler_that_outlives_its_deadline_on_its_own_terms_is_answered_as_it_says(
    bus: Bus, service: str, serve: Callable[[Handler], Awaitable[RpcServer]]
) -> None:
    """Cancelled at the deadline, a handler may still answer, or fail with an error of its own:
    the caller gets that, as under ``asyncio.timeout``, and the server keeps nothing of it."""

    async def stubborn(request: GenerateRequest) -> GenerateResponse:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            if request.prompt == "answer":
                return GenerateResponse(text="late but here")
            raise NotFound("gone while waiting", code="GONE") from None
        raise AssertionError("unreachable")

    server = await serve(stubborn)
    subject = bus.subjects.rpc(service, "Generate")

    async def call(prompt: str) -> tuple[int, bytes]:
        # The deadline in the envelope; the caller itself waits longer, to see what comes.
        data = frames.request(GenerateRequest(prompt=prompt).SerializeToString(), deadline=time.time() + 0.2)
        return frames.parse_reply((await bus.nc.request(subject, data, timeout=5)).data)

    status, body = await call("answer")
    assert status == frames.OK
    assert GenerateResponse.FromString(body).text == "late but here"
    status, body = await call("fail")
    assert status == frames.ERROR
    assert common_pb2.Error.FromString(body).code == "GONE"
    # No await is left registered (expired or not) with the server's deadlines.
    assert len(server._deadlines) == 0


async def test_a_handlers_own_timeout_is_a_deadline_error(
    bus: Bus, service: str, serve: Callable[[Handler], Awaitable[RpcServer]]
) -> None:
    async def times_out(request: GenerateRequest) -> GenerateResponse:
        await asyncio.wait_for(asyncio.Event().wait(), 0.05)
        raise AssertionError("unreachable")

    await serve(times_out)
    with pytest.raises(DeadlineExceeded):
        await RpcClient(bus).call(
            service, "Generate", GenerateRequest(prompt="a"), GenerateResponse, timeout=5
        )


async def test_expired_deadline_is_not_handled(
    bus: Bus, service: str, serve: Callable[[Handler], Awaitable[RpcServer]]
) -> None:
    calls: list[str] = []

    async def handler(request: GenerateRequest) -> GenerateResponse:
        calls.append(request.prompt)
        return GenerateResponse()

    await serve(handler)
    reply = await bus.nc.request(
        bus.subjects.rpc(service, "Generate"),
        frames.request(GenerateRequest().SerializeToString(), deadline=time.time() - 1),
        timeout=5,
    )
    status, body = frames.parse_reply(reply.data)
    assert status == frames.ERROR
    envelope = common_pb2.Error.FromString(body)
    assert envelope.kind == common_pb2.ERROR_KIND_DEADLINE_EXCEEDED
    assert calls == []


async def test_no_responders_is_unavailable_fast(bus: Bus, service: str) -> None:
    started = time.monotonic()
    with pytest.raises(Unavailable) as caught:
        await RpcClient(bus).call(service, "Generate", GenerateRequest(), GenerateResponse, timeout=5)
    assert caught.value.code == "NO_RESPONDERS"
    assert caught.value.retryable
    assert time.monotonic() - started < 2


async def test_unregistered_method_has_no_responders(
    bus: Bus, service: str, serve: Callable[[Handler], Awaitable[RpcServer]]
) -> None:
    await serve(echo)
    with pytest.raises(Unavailable) as caught:
        await RpcClient(bus).call(service, "Embed", GenerateRequest(), GenerateResponse, timeout=5)
    assert caught.value.code == "NO_RESPONDERS"


async def test_replicas_share_requests_in_a_queue_group(bus: Bus, test_env: SessionEnv, service: str) -> None:
    total = 200
    served: dict[str, Counter[str]] = {"one": Counter(), "two": Counter()}
    buses: list[Bus] = []
    servers: list[RpcServer] = []
    try:
        for replica in served:
            own = await Bus.connect(
                test_env.nats_url, name=f"replica-{replica}", namespace=test_env.namespace
            )
            buses.append(own)

            async def handler(request: GenerateRequest, replica: str = replica) -> GenerateResponse:
                served[replica][request.prompt] += 1
                await asyncio.sleep(0.005)  # simulated work, so both replicas are busy at once
                return GenerateResponse(text=request.prompt.upper(), provider=replica)

            server = RpcServer(own, service)
            server.register("Generate", GenerateRequest, handler)
            await server.start()
            await own.nc.flush()
            servers.append(server)

        client = RpcClient(bus)
        prompts = [f"p{i}" for i in range(total)]
        replies = await asyncio.gather(
            *(client.call(service, "Generate", GenerateRequest(prompt=p), GenerateResponse) for p in prompts)
        )
    finally:
        for server in servers:
            await server.stop(timeout=2)
        for own in buses:
            await own.close()

    assert [r.text for r in replies] == [p.upper() for p in prompts]
    one, two = served["one"], served["two"]
    assert one, f"replica one took nothing ({len(two)} to two)"
    assert two, f"replica two took nothing ({len(one)} to one)"
    assert not set(one) & set(two)
    assert set(one) | set(two) == set(prompts)
    assert set(one.values()) | set(two.values()) == {1}
    assert Counter(r.provider for r in replies) == {"one": len(one), "two": len(two)}


async def test_stop_answers_requests_already_received(bus: Bus, service: str) -> None:
    gate = asyncio.Event()
    entered: list[str] = []

    async def handler(request: GenerateRequest) -> GenerateResponse:
        entered.append(request.prompt)
        await gate.wait()
        return GenerateResponse(text=request.prompt)

    server = RpcServer(bus, service, max_concurrency=1)
    server.register("Generate", GenerateRequest, handler)
    await server.start()
    await bus.nc.flush()
    sub = server._subs[0]
    client = RpcClient(bus)
    calls = [
        asyncio.create_task(
            client.call(service, "Generate", GenerateRequest(prompt=p), GenerateResponse, timeout=4)
        )
        for p in "abc"
    ]

    async def all_received() -> bool:
        return entered == ["a"] and sub.delivered == 3

    await eventually(all_received, what="three requests at the replica, one being served")
    stopping = asyncio.create_task(server.stop(timeout=5))

    async def intake_stopped() -> bool:
        try:
            await client.call(
                service, "Generate", GenerateRequest(prompt="late"), GenerateResponse, timeout=0.5
            )
        except Unavailable:
            return True
        except DeadlineExceeded:
            return False
        raise AssertionError("a request after stop() was served")

    await eventually(intake_stopped, what="no responders once stopping")
    gate.set()
    started = time.monotonic()
    async with asyncio.timeout(10):
        replies = await asyncio.gather(*calls, return_exceptions=True)
        await stopping
    assert [getattr(r, "text", r) for r in replies] == ["a", "b", "c"]
    assert time.monotonic() - started < 2, "queued requests waited out their deadline"


async def test_a_reply_in_no_envelope_is_a_bad_reply(bus: Bus, service: str) -> None:
    """A responder that does not speak the envelope (a plain protobuf reply, or an empty one) is
    reported as such, not read as a response."""
    subject = bus.subjects.rpc(service, "Generate")
    answers = [GenerateResponse(text="no envelope").SerializeToString(), b""]

    async def plain(msg: object) -> None:
        await bus.nc.publish(msg.reply, answers.pop(0))  # type: ignore[attr-defined]

    sub = await bus.nc.subscribe(subject, cb=plain)
    try:
        for _ in range(2):
            with pytest.raises(ParleyError) as caught:
                await RpcClient(bus).call(service, "Generate", GenerateRequest(), GenerateResponse, timeout=5)
            assert caught.value.code == "BAD_REPLY"
            assert "envelope" in caught.value.message
    finally:
        await sub.unsubscribe()
    assert answers == []
