"""The operator-facing gRPC server: health, reflection, bearer-token auth,
deadlines, and one mapping from Parley errors to gRPC status codes."""

from __future__ import annotations

import asyncio
import functools
import hmac
import inspect
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any

import grpc
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


def _wrap_unary(
    fn: Callable[..., Awaitable[Any]], name: str, default_timeout: float
) -> Callable[..., Awaitable[Any]]:
    @functools.wraps(fn)
    async def method(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        remaining = context.time_remaining()
        budget = default_timeout if remaining is None else min(remaining, default_timeout)
        try:
            async with asyncio.timeout(budget):
                return await fn(request, context)
        except ParleyError as exc:
            await _abort(context, exc)
        except TimeoutError:
            await _abort(context, codes.DEADLINE_EXCEEDED(f"{name} did not finish within {budget:.1f}s"))
        except grpc.aio.AbortError:
            raise
        except Exception:
            log.exception("grpc handler crashed", method=name)
            await context.abort(grpc.StatusCode.INTERNAL, f"{name} failed unexpectedly; see the service log")

    return method


async def _abort(context: grpc.aio.ServicerContext[Any, Any], exc: ParleyError) -> None:
    context.set_trailing_metadata(((ERROR_METADATA_KEY, exc.to_proto().SerializeToString()),))
    message = exc.message + (f" (hint: {exc.hint})" if exc.hint else "")
    await context.abort(exc.grpc_status, f"{exc.code}: {message}")


def with_error_mapping(servicer: Any, base: type, *, default_timeout: float = 60.0) -> Any:
    """Wrap each RPC of ``servicer`` (declared on the generated ``base``) so that
    Parley errors become the mapped gRPC status and every call has a deadline."""
    for name, _ in inspect.getmembers(base, inspect.isfunction):
        if name.startswith("_"):
            continue
        impl = getattr(servicer, name)
        if inspect.isasyncgenfunction(impl):
            continue
        setattr(servicer, name, _wrap_unary(impl, name, default_timeout))
    return servicer


@dataclass
class ServiceBinding:
    servicer: Any
    add_to_server: Callable[[Any, grpc.aio.Server], None]
    full_name: str
    base: type


class GrpcServer:
    def __init__(self, server: grpc.aio.Server, port: int, health_servicer: Any) -> None:
        self.server = server
        self.port = port
        self.health = health_servicer

    async def stop(self, grace: float = 5.0) -> None:
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace)


async def start_grpc_server(
    bindings: Iterable[ServiceBinding], *, host: str, port: int, token: str, default_timeout: float = 60.0
) -> GrpcServer:
    # gRPC sets SO_REUSEPORT by default: a second server would share a busy port silently.
    server = grpc.aio.server(interceptors=[BearerTokenInterceptor(token)], options=[("grpc.so_reuseport", 0)])
    names = [health.SERVICE_NAME, reflection.SERVICE_NAME]
    health_servicer = health.aio.HealthServicer()  # type: ignore[attr-defined]
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    bindings = list(bindings)
    for binding in bindings:
        binding.add_to_server(
            with_error_mapping(binding.servicer, binding.base, default_timeout=default_timeout), server
        )
        names.append(binding.full_name)
    reflection.enable_server_reflection(names, server)
    try:
        bound = server.add_insecure_port(f"{host}:{port}")
    except RuntimeError:
        bound = 0
    if bound == 0:
        raise codes.PORT_IN_USE(f"cannot listen for gRPC on {host}:{port}")
    await server.start()
    for name in ["", *(b.full_name for b in bindings)]:
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    log.info("grpc serving", port=bound, services=",".join(b.full_name for b in bindings))
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
