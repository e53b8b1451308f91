"""Undecodable requests are bad input on every gRPC method of every service.

Random and truncated bytes go to every method (unary and server-streaming) of the five services
running as real processes: each call ends with INVALID_ARGUMENT naming the expected message type,
or a proper domain error when the bytes happen to decode into a request, never UNKNOWN, INTERNAL or
a Python class name; every service still answers its health check afterwards.
"""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from parley.v1 import (
    actions_pb2,
    authz_pb2,
    documents_pb2,
    model_pb2,
    pairing_pb2,
    runtime_pb2,
    scheduler_pb2,
)
from support import Suite

# (proto module, service) per process: the runtime serves three.
SERVICES: dict[str, list[tuple[Any, str]]] = {
    "runtime": [(runtime_pb2, "Runtime"), (actions_pb2, "CustomActions"), (documents_pb2, "Documents")],
    "gateway": [(model_pb2, "ModelGateway")],
    "pairing": [(pairing_pb2, "Pairing")],
    "authz": [(authz_pb2, "Authz")],
    "scheduler": [(scheduler_pb2, "Scheduler")],
}
# What a call may end with: bad input, or a domain answer when the bytes decode into a request.
ACCEPTABLE = {
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.ALREADY_EXISTS,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.OUT_OF_RANGE,
    grpc.StatusCode.ABORTED,
}
LEAKS = ("<class", "Traceback", "DecodeError", "google.protobuf", "Exception")


def payloads(rng: random.Random) -> list[bytes]:
    """Twelve inputs: malformed by construction (truncated length, bad wire type, overlong varint,
    a group that never ends) and random bytes of several sizes."""
    return [
        b"\x0a\x05ab",  # field 1, length 5, 2 bytes follow
        b"\x0a\xff\xff\xff\xff\x0f",  # field 1, a length of 4 GiB
        b"\x0f",  # field 1, wire type 7 (none such)
        b"\x08" + b"\xff" * 11,  # a varint longer than 10 bytes
        b"\x0b",  # field 1, start group, never ended
        b"\x00",  # field number 0
        b"\xff",  # a truncated tag
        *(rng.randbytes(size) for size in (1, 3, 16, 64, 512)),
    ]


async def start_everything(suite: Suite) -> dict[str, int]:
    await suite.start()
    ports = {"runtime": suite.runtime.grpc_port}
    assert suite.gateway is not None
    ports["gateway"] = suite.gateway.grpc_port
    for name, module, key in (
        ("pairing", "parley_pairing", "PAIRING"),
        ("authz", "parley_authz", "AUTHZ"),
        ("scheduler", "parley_scheduler", "SCHEDULER"),
    ):
        ports[name] = (await suite.add_service(module, key)).grpc_port
    return ports


async def call(
    channel: grpc.aio.Channel, path: str, streaming: bool, body: bytes, token: str
) -> grpc.aio.AioRpcError | None:
    metadata = (("authorization", f"Bearer {token}"),)
    try:
        if streaming:
            stream = channel.unary_stream(path)(body, metadata=metadata, timeout=15)
            async for _ in stream:
                pass
        else:
            await channel.unary_unary(path)(body, metadata=metadata, timeout=15)
    except grpc.aio.AioRpcError as error:
        return error
    return None


@pytest.mark.timeout(600)
async def test_random_and_truncated_bytes_on_every_method_are_bad_input(isolated_suite: Suite) -> None:
    ports = await start_everything(isolated_suite)
    rng = random.Random(12)
    outcomes: Counter[str] = Counter()
    wrong: list[str] = []
    for process, services in SERVICES.items():
        async with grpc.aio.insecure_channel(f"127.0.0.1:{ports[process]}") as channel:
            for module, service in services:
                descriptor = module.DESCRIPTOR.services_by_name[service]
                for method in descriptor.methods:
                    path = f"/{descriptor.full_name}/{method.name}"
                    inputs = payloads(rng)
                    results = await asyncio.gather(
                        *(
                            call(channel, path, method.server_streaming, body, isolated_suite.env.token)
                            for body in inputs
                        )
                    )
                    for body, error in zip(inputs, results, strict=True):
                        code = error.code() if error else grpc.StatusCode.OK
                        outcomes[code.name] += 1
                        details = (error.details() or "") if error else ""
                        if code not in ACCEPTABLE or any(leak in details for leak in LEAKS):
                            wrong.append(f"{path} {body[:16]!r}: {code.name} {details[:120]}")
                        if (
                            error
                            and code == grpc.StatusCode.INVALID_ARGUMENT
                            and "INVALID_PAYLOAD" in details
                        ):
                            assert method.input_type.full_name in details, (path, details)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{ports[process]}") as channel:
            health = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=5
            )
            assert health.status == health_pb2.HealthCheckResponse.SERVING, process
    total = sum(outcomes.values())
    print(f"\n{total} fuzzed calls: {dict(outcomes)}")
    assert not wrong, f"{len(wrong)} of {total} calls were not bad input:\n" + "\n".join(wrong[:40])
    assert outcomes["INVALID_ARGUMENT"] > total // 2, outcomes  # most of these bytes cannot be a request
    methods = sum(
        len(module.DESCRIPTOR.services_by_name[service].methods)
        for listed in SERVICES.values()
        for module, service in listed
    )
    assert total == methods * 12  # every method of the five services was tried with every input
