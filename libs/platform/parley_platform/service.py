"""One implementation, two transports.

A service implements its protobuf ``service`` as an object with one async
method per RPC, taking the request message and returning the response. This
module serves that object over gRPC (for operators) and NATS request/reply
(for services), with the same messages and the same error codes.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from google.protobuf.descriptor import ServiceDescriptor

from .grpcserver import ServiceBinding
from .rpc import RpcServer


def _descriptor(pb2: ModuleType, service: str) -> ServiceDescriptor:
    return pb2.DESCRIPTOR.services_by_name[service]  # type: ignore[no-any-return]


def register_nats(server: RpcServer, impl: Any, pb2: ModuleType, service: str) -> None:
    for method in _descriptor(pb2, service).methods:
        if method.server_streaming or method.client_streaming:
            continue
        request_type = getattr(pb2, method.input_type.name)
        server.register(method.name, request_type, getattr(impl, method.name))


def grpc_binding(impl: Any, pb2: ModuleType, pb2_grpc: ModuleType, service: str) -> ServiceBinding:
    base: type = getattr(pb2_grpc, f"{service}Servicer")
    namespace: dict[str, Any] = {}
    for method in _descriptor(pb2, service).methods:
        target = getattr(impl, method.name)

        async def call(self: Any, request: Any, context: Any, _target: Any = target) -> Any:
            return await _target(request)

        namespace[method.name] = call
    servicer_cls = type(f"{service}GrpcServicer", (base,), namespace)
    return ServiceBinding(
        servicer=servicer_cls(),
        add_to_server=getattr(pb2_grpc, f"add_{service}Servicer_to_server"),
        full_name=_descriptor(pb2, service).full_name,
        base=base,
    )
