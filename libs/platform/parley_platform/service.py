"""One implementation, two transports.

A service implements its protobuf ``service`` as an object with one async method per RPC,
taking the request message and returning the response (an async generator for a
server-streaming RPC). This module serves that object over gRPC (for operators) and NATS
request/reply (for services), with the same messages and the same error codes. The NATS
name of a service is its ``(parley.v1.nats_service)`` option in the proto.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from google.protobuf import message_factory
from google.protobuf.descriptor import ServiceDescriptor

from parley.v1 import common_pb2

from .grpcserver import Method, ServiceBinding
from .rpc import RpcServer


class Combined:
    """One protobuf service implemented by several objects, each owning some of its methods."""

    def __init__(self, *parts: object) -> None:
        self._parts = parts

    def __getattr__(self, name: str) -> Any:
        for part in self._parts:
            if hasattr(part, name):
                return getattr(part, name)
        raise AttributeError(name)


def descriptor(pb2: ModuleType, service: str) -> ServiceDescriptor:
    return pb2.DESCRIPTOR.services_by_name[service]  # type: ignore[no-any-return]


def nats_name(pb2: ModuleType, service: str) -> str:
    """The service's NATS name: its methods are ``<namespace>.<name>.<Method>``."""
    return str(descriptor(pb2, service).GetOptions().Extensions[common_pb2.nats_service])


def methods(impl: Any, pb2: ModuleType, service: str) -> tuple[Method, ...]:
    return tuple(
        Method(
            name=m.name,
            call=getattr(impl, m.name),
            request_type=message_factory.GetMessageClass(m.input_type),
            streaming=m.server_streaming,
        )
        for m in descriptor(pb2, service).methods
    )


def register_nats(server: RpcServer, impl: Any, pb2: ModuleType, service: str) -> None:
    """Every method over NATS: unary ones as request/reply, server-streaming ones as streamed
    calls (``rpcstream``)."""
    for method in methods(impl, pb2, service):
        if method.streaming:
            server.register_stream(method.name, method.request_type, method.call)
        else:
            server.register(method.name, method.request_type, method.call)


def grpc_binding(impl: Any, pb2: ModuleType, service: str) -> ServiceBinding:
    return ServiceBinding(descriptor(pb2, service).full_name, methods(impl, pb2, service))
