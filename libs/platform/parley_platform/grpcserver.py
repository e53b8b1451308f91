"""The operator-facing gRPC server: health, reflection, bearer-token auth,
deadlines, and one mapping from Parley errors to gRPC status codes."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from google.protobuf.message import DecodeError, Message
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from parley.v1 import common_pb2

from . import codes
from .errors import KIND_OF_STATUS, Kind, ParleyError
from .logging import get_logger

log = get_logger(__name__)

ERROR_METADATA_KEY = "parley-error-bin"
# grpc-stubs types method handlers poorly; they stay opaque here.
Handler = Any
_OPEN_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")


def _abort_handler(handler: Handler, code: grpc.StatusCode, message: str) -> Handler:
    envelope = codes.UNAUTHENTICATED(message).to_proto().SerializeToString()

    async def abort(_request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        context.set_trailing_metadata(((ERROR_METADATA_KEY, envelope),))
        await context.abort(code, message)

    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(abort)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(abort)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(abort)
    return grpc.unary_unary_rpc_method_handler(abort)


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[type-arg]
    """Requires ``authorization: Bearer <token>``; health and reflection stay open."""

    def __init__(self, token: str) -> None:
        if not token.strip():
            # An empty token would let in anyone who sends "authorization: Bearer ".
            raise codes.OPERATOR_TOKEN_EMPTY("the operator token is empty")
        self._expected = f"Bearer {token}".encode()

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Handler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> Handler:
        handler = await continuation(handler_call_details)
        method = handler_call_details.method or ""
        if handler is None or method.startswith(_OPEN_PREFIXES):
            return handler
        presented = b""
        for key, value in handler_call_details.invocation_metadata or ():
            if key == "authorization":
                presented = value.encode() if isinstance(value, str) else value
        if not presented:
            return _abort_handler(
                handler,
                grpc.StatusCode.UNAUTHENTICATED,
                "missing bearer token: send 'authorization: Bearer <PARLEY_OPERATOR_TOKEN>'",
            )
        if not hmac.compare_digest(presented, self._expected):
            return _abort_handler(handler, grpc.StatusCode.UNAUTHENTICATED, "invalid bearer token")
        return handler


@dataclass(frozen=True)
class Method:
    """One RPC of a service: the implementation and the message it takes."""

    name: str
    call: Callable[[Any], Any]  # async function, or async generator for server-streaming methods
    request_type: type[Message]
    streaming: bool = False


@dataclass(frozen=True)
class ServiceBinding:
    full_name: str
    methods: tuple[Method, ...]


def _decode(method: Method, raw: bytes) -> Message:
    """Requests arrive as bytes and are decoded here, so that bytes which are not the method's
    message are INVALID_ARGUMENT naming the expected type (gRPC's own decoding answers UNKNOWN)."""
    try:
        return method.request_type.FromString(raw)
    except (DecodeError, RuntimeWarning) as exc:
        raise codes.INVALID_PAYLOAD(
            f"{method.name}: the request is not a valid {method.request_type.DESCRIPTOR.full_name}"
        ) from exc


def _budget(context: grpc.aio.ServicerContext[Any, Any], default_timeout: float) -> float:
    remaining = context.time_remaining()
    return default_timeout if remaining is None else min(remaining, default_timeout)


def _unary(method: Method, default_timeout: float) -> Handler:
    async def handle(raw: bytes, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        budget = _budget(context, default_timeout)
        try:
            request = _decode(method, raw)
            async with asyncio.timeout(budget):
                return await method.call(request)
        except ParleyError as exc:
            await _abort(context, exc)
        except TimeoutError:
            await _abort(
                context, codes.DEADLINE_EXCEEDED(f"{method.name} did not finish within {budget:.1f}s")
            )
        except grpc.aio.AbortError:
            raise
        except Exception:
            log.exception("grpc handler crashed", method=method.name)
            await _abort(context, codes.INTERNAL(f"{method.name} failed unexpectedly"))

    return grpc.unary_unary_rpc_method_handler(handle, response_serializer=_serialize)


def _stream(method: Method, default_timeout: float) -> Handler:
    async def handle(raw: bytes, context: grpc.aio.ServicerContext[Any, Any]) -> AsyncIterator[Any]:
        budget = _budget(context, default_timeout)
        try:
            request = _decode(method, raw)
            # Closed however the call ends (the client cancelling included), not by the GC.
            async with asyncio.timeout(budget), contextlib.aclosing(method.call(request)) as items:
                async for item in items:
                    yield item
        except ParleyError as exc:
            await _abort(context, exc)
        except TimeoutError:
            await _abort(
                context, codes.DEADLINE_EXCEEDED(f"{method.name} did not finish within {budget:.1f}s")
            )
        except grpc.aio.AbortError:
            raise
        except Exception:
            log.exception("grpc handler crashed", method=method.name)
            await _abort(context, codes.INTERNAL(f"{method.name} failed unexpectedly"))

    return grpc.unary_stream_rpc_method_handler(handle, response_serializer=_serialize)


def _serialize(message: Message) -> bytes:
    return message.SerializeToString()


async def _abort(context: grpc.aio.ServicerContext[Any, Any], exc: ParleyError) -> None:
    context.set_trailing_metadata(((ERROR_METADATA_KEY, exc.to_proto().SerializeToString()),))
    message = exc.message + (f" (hint: {exc.hint})" if exc.hint else "")
    await context.abort(exc.grpc_status, f"{exc.code}: {message}")


def _handlers(binding: ServiceBinding, default_timeout: float) -> Handler:
    return grpc.method_handlers_generic_handler(
        binding.full_name,
        {m.name: (_stream if m.streaming else _unary)(m, default_timeout) for m in binding.methods},
    )


class GrpcServer:
    def __init__(self, server: grpc.aio.Server, port: int, health_servicer: Any) -> None:
        self.server = server
        self.port = port
        self.health = health_servicer

    async def stop(self, grace: float = 5.0) -> None:
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace)


@dataclass(frozen=True)
class ServerTls:
    """The gRPC server's certificate (chain) and private key, PEM files."""

    cert: Path
    key: Path

    def credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials([(self.key.read_bytes(), self.cert.read_bytes())])


def open_channel(address: str, *, tls_ca: Path | None = None) -> grpc.aio.Channel:
    """A client channel to a service: TLS verified against ``tls_ca`` when given, else plaintext."""
    if tls_ca is None:
        return grpc.aio.insecure_channel(address)
    return grpc.aio.secure_channel(
        address, grpc.ssl_channel_credentials(root_certificates=tls_ca.read_bytes())
    )


async def start_grpc_server(
    bindings: Iterable[ServiceBinding],
    *,
    host: str,
    port: int,
    token: str,
    default_timeout: float = 60.0,
    tls: ServerTls | None = None,
) -> GrpcServer:
    """Serve ``bindings`` with health and reflection on ``host:port``: over TLS only when ``tls``
    is given, else plaintext."""
    # gRPC sets SO_REUSEPORT by default: a second server would share a busy port silently.
    server = grpc.aio.server(interceptors=[BearerTokenInterceptor(token)], options=[("grpc.so_reuseport", 0)])
    names = [health.SERVICE_NAME, reflection.SERVICE_NAME]
    health_servicer = health.aio.HealthServicer()  # type: ignore[attr-defined]
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    bindings = list(bindings)
    for binding in bindings:
        server.add_generic_rpc_handlers([_handlers(binding, default_timeout)])
        names.append(binding.full_name)
    reflection.enable_server_reflection(names, server)
    try:
        address = f"{host}:{port}"
        bound = (
            server.add_secure_port(address, tls.credentials()) if tls else server.add_insecure_port(address)
        )
    except RuntimeError:
        bound = 0
    if bound == 0:
        raise codes.PORT_IN_USE(f"cannot listen for gRPC on {host}:{port}")
    await server.start()
    for name in ["", *(b.full_name for b in bindings)]:
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    log.info(
        "grpc serving", port=bound, tls=tls is not None, services=",".join(b.full_name for b in bindings)
    )
    return GrpcServer(server, bound, health_servicer)


def error_from_rpc_error(exc: grpc.aio.AioRpcError) -> ParleyError:
    """Client side: turn a gRPC failure back into the Parley error it carried."""
    metadata: Any = exc.trailing_metadata() or ()
    for key, value in metadata:
        if key == ERROR_METADATA_KEY and isinstance(value, bytes):
            return ParleyError.from_proto(common_pb2.Error.FromString(value))
    kind = KIND_OF_STATUS.get(exc.code(), Kind.INTERNAL)
    restored = ParleyError.from_proto(
        common_pb2.Error(code=exc.code().name, message=exc.details() or "", kind=kind.value)
    )
    # Without an envelope nothing says whether to retry: the kind's default decides
    # (a refused connection is Unavailable, and retryable), not the envelope's zero value.
    return type(restored)(restored.message, code=restored.code)
