"""The operator-facing gRPC server over a real socket: auth, error mapping, deadlines,
health, reflection, and one implementation served over both gRPC and NATS."""

from __future__ import annotations

import asyncio
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from parley.v1 import model_pb2, model_pb2_grpc
from parley_devinfra.infra import free_port
from parley_platform.bus import Bus
from parley_platform.errors import (
    Conflict,
    DeadlineExceeded,
    FailedPrecondition,
    Internal,
    InvalidArgument,
    NotFound,
    ParleyError,
    ResourceExhausted,
    Unauthenticated,
    Unavailable,
)
from parley_platform.grpcserver import ERROR_METADATA_KEY, GrpcServer, error_from_rpc_error, start_grpc_server
from parley_platform.rpc import RpcClient, RpcServer
from parley_platform.service import grpc_binding, register_nats
from parley_platform.testing import eventually

SERVICE = "parley.v1.ModelGateway"

FAILURES: dict[str, tuple[ParleyError, grpc.StatusCode]] = {
    "invalid": (
        InvalidArgument("prompt must not mention llamas", code="LLAMA_PROMPT", hint="try alpacas"),
        grpc.StatusCode.INVALID_ARGUMENT,
    ),
    "missing": (
        NotFound("model tiny-3 is not configured", code="MODEL_NOT_FOUND"),
        grpc.StatusCode.NOT_FOUND,
    ),
    "conflict": (Conflict("ledger moved on", code="CAS_FAILED", retryable=True), grpc.StatusCode.ABORTED),
    "precondition": (
        FailedPrecondition("provider disabled", code="PROVIDER_DISABLED", hint="enable it first"),
        grpc.StatusCode.FAILED_PRECONDITION,
    ),
    "exhausted": (
        ResourceExhausted("token budget spent", code="BUDGET_SPENT"),
        grpc.StatusCode.RESOURCE_EXHAUSTED,
    ),
}


@dataclass
class Gateway:
    """A test implementation of the ModelGateway contract; the server plumbing is what is tested."""

    calls: list[str] = field(default_factory=list)
    cancelled: list[str] = field(default_factory=list)

    async def Generate(self, request: model_pb2.GenerateRequest) -> model_pb2.GenerateResponse:
        self.calls.append(request.prompt)
        if request.prompt in FAILURES:
            raise FAILURES[request.prompt][0]
        if request.prompt == "crash":
            raise ZeroDivisionError("secret sauce recipe")
        if request.prompt == "slow":
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                self.cancelled.append(request.prompt)
                raise
        return model_pb2.GenerateResponse(
            text=request.prompt.upper(),
            provider="test",
            usage=model_pb2.Usage(input_tokens=len(request.prompt)),
        )

    def __getattr__(self, rpc: str) -> Callable[[Any], Awaitable[Any]]:
        """Every other RPC of the (growing) contract: served, but not what these tests exercise."""
        if not rpc[:1].isupper():
            raise AttributeError(rpc)

        async def unused(request: Any) -> Any:
            raise FailedPrecondition(f"{rpc} is not part of this test", code="NOT_IN_TEST")

        return unused


@dataclass
class Served:
    impl: Gateway
    server: GrpcServer
    channel: grpc.aio.Channel
    token: str

    @property
    def stub(self) -> model_pb2_grpc.ModelGatewayStub:
        return model_pb2_grpc.ModelGatewayStub(self.channel)

    @property
    def auth(self) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {self.token}"),)


@asynccontextmanager
async def serving(default_timeout: float = 60.0) -> AsyncIterator[Served]:
    impl = Gateway()
    token = secrets.token_urlsafe(24)
    binding = grpc_binding(impl, model_pb2, "ModelGateway")
    server = await start_grpc_server(
        [binding], host="127.0.0.1", port=0, token=token, default_timeout=default_timeout
    )
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            yield Served(impl, server, channel, token)
    finally:
        await server.stop(grace=1)


@pytest.fixture
async def served() -> AsyncIterator[Served]:
    async with serving() as running:
        yield running


async def call_error(served: Served, prompt: str, **kwargs: Any) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await served.stub.Generate(model_pb2.GenerateRequest(prompt=prompt), **kwargs)
    return caught.value


async def test_authorised_call_succeeds(served: Served) -> None:
    reply = await served.stub.Generate(
        model_pb2.GenerateRequest(prompt="hi"), metadata=served.auth, timeout=5
    )
    assert reply.text == "HI"
    assert reply.usage.input_tokens == 2
    assert served.impl.calls == ["hi"]


@pytest.mark.parametrize("prompt", sorted(FAILURES))
async def test_parley_errors_map_to_status_and_round_trip(served: Served, prompt: str) -> None:
    sent, status = FAILURES[prompt]
    err = await call_error(served, prompt, metadata=served.auth, timeout=5)
    assert err.code() == status
    assert sent.message in (err.details() or "")
    assert sent.code in (err.details() or "")
    envelopes = [v for k, v in (err.trailing_metadata() or ()) if k == ERROR_METADATA_KEY]
    assert len(envelopes) == 1

    restored = error_from_rpc_error(err)
    assert type(restored) is type(sent)
    assert (restored.code, restored.message, restored.hint, restored.retryable) == (
        sent.code,
        sent.message,
        sent.hint,
        sent.retryable,
    )


async def test_invalid_argument_says_what_the_handler_said(served: Served) -> None:
    err = await call_error(served, "invalid", metadata=served.auth, timeout=5)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    details = err.details() or ""
    assert "prompt must not mention llamas" in details
    assert "try alpacas" in details


async def test_crash_is_internal_without_the_exception_text(served: Served) -> None:
    err = await call_error(served, "crash", metadata=served.auth, timeout=5)
    assert err.code() == grpc.StatusCode.INTERNAL
    assert "secret sauce" not in (err.details() or "")
    assert "ZeroDivisionError" not in (err.details() or "")
    restored = error_from_rpc_error(err)
    assert isinstance(restored, Internal)
    assert "secret sauce" not in str(restored)


@pytest.mark.parametrize(
    "metadata",
    [
        pytest.param((), id="missing"),
        pytest.param((("authorization", "Bearer not-the-token"),), id="wrong"),
        pytest.param((("authorization", "not-even-bearer"),), id="malformed"),
        pytest.param((("authorization", ""),), id="empty"),
    ],
)
async def test_bad_or_missing_token_is_unauthenticated(
    served: Served, metadata: tuple[tuple[str, str], ...]
) -> None:
    err = await call_error(served, "hi", metadata=metadata, timeout=5)
    assert err.code() == grpc.StatusCode.UNAUTHENTICATED
    assert served.token not in (err.details() or "")
    assert isinstance(error_from_rpc_error(err), Unauthenticated)
    assert served.impl.calls == []


async def test_token_prefix_or_extension_is_rejected(served: Served) -> None:
    for presented in (f"Bearer {served.token[:-1]}", f"Bearer {served.token}x", f"bearer {served.token}"):
        err = await call_error(served, "hi", metadata=(("authorization", presented),), timeout=5)
        assert err.code() == grpc.StatusCode.UNAUTHENTICATED
    assert served.impl.calls == []


async def test_health_answers_serving_without_a_token(served: Served) -> None:
    health = health_pb2_grpc.HealthStub(served.channel)
    for name in ("", SERVICE):
        reply = await health.Check(health_pb2.HealthCheckRequest(service=name), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING


async def test_reflection_lists_the_service_without_a_token(served: Served) -> None:
    stub = reflection_pb2_grpc.ServerReflectionStub(served.channel)
    call = stub.ServerReflectionInfo(timeout=5)
    await call.write(reflection_pb2.ServerReflectionRequest(list_services=""))
    listed = await call.read()
    await call.write(reflection_pb2.ServerReflectionRequest(file_containing_symbol=SERVICE))
    described = await call.read()
    await call.done_writing()
    names = {s.name for s in listed.list_services_response.service}
    assert {SERVICE, "grpc.health.v1.Health"} <= names
    assert described.file_descriptor_response.file_descriptor_proto, "no descriptor for the service"


async def test_server_default_deadline_applies() -> None:
    async with serving(default_timeout=0.3) as served:
        started = time.monotonic()
        err = await call_error(served, "slow", metadata=served.auth)
        assert time.monotonic() - started < 5
        assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert isinstance(error_from_rpc_error(err), DeadlineExceeded)

        async def cancelled() -> bool:
            return served.impl.cancelled == ["slow"]

        await eventually(cancelled, timeout=5, what="slow handler cancelled")


async def test_client_deadline_cancels_the_handler(served: Served) -> None:
    err = await call_error(served, "slow", metadata=served.auth, timeout=0.3)
    assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED

    async def cancelled() -> bool:
        return served.impl.cancelled == ["slow"]

    await eventually(cancelled, timeout=5, what="slow handler cancelled")


async def test_one_implementation_serves_both_transports(bus: Bus, served: Served) -> None:
    service = f"gw{uuid.uuid4().hex[:10]}"
    nats_server = RpcServer(bus, service)
    register_nats(nats_server, served.impl, model_pb2, "ModelGateway")
    await nats_server.start()
    await bus.nc.flush()
    try:
        client = RpcClient(bus)
        over_nats = await client.call(
            service, "Generate", model_pb2.GenerateRequest(prompt="both"), model_pb2.GenerateResponse
        )
        over_grpc = await served.stub.Generate(
            model_pb2.GenerateRequest(prompt="both"), metadata=served.auth, timeout=5
        )
        assert over_nats == over_grpc
        for prompt, (sent, _) in FAILURES.items():
            with pytest.raises(ParleyError) as caught:
                await client.call(
                    service, "Generate", model_pb2.GenerateRequest(prompt=prompt), model_pb2.GenerateResponse
                )
            grpc_err = error_from_rpc_error(await call_error(served, prompt, metadata=served.auth, timeout=5))
            for got in (caught.value, grpc_err):
                assert (type(got), got.code, got.kind) == (type(sent), sent.code, sent.kind)
    finally:
        await nats_server.stop(timeout=2)


async def test_port_in_use_is_refused() -> None:
    """gRPC's default SO_REUSEPORT would let a second server share the port silently."""
    async with serving() as first:
        binding = grpc_binding(Gateway(), model_pb2, "ModelGateway")
        with pytest.raises(ParleyError) as caught:
            await start_grpc_server([binding], host="127.0.0.1", port=first.server.port, token="t")
        assert caught.value.code == "PORT_IN_USE"


@pytest.mark.parametrize("token", ["", "   "])
async def test_empty_token_is_refused_at_start(token: str) -> None:
    """An empty token would admit anyone sending ``authorization: Bearer ``."""
    binding = grpc_binding(Gateway(), model_pb2, "ModelGateway")
    with pytest.raises(InvalidArgument) as caught:
        await start_grpc_server([binding], host="127.0.0.1", port=0, token=token)
    assert caught.value.code == "OPERATOR_TOKEN_EMPTY"


async def test_unreachable_server_is_unavailable() -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{free_port()}") as channel:
        stub = model_pb2_grpc.ModelGatewayStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await stub.Generate(model_pb2.GenerateRequest(prompt="x"), timeout=5)
    restored = error_from_rpc_error(caught.value)
    assert isinstance(restored, Unavailable)
    assert restored.retryable
