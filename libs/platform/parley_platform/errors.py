"""One exception root for Parley, with a stable code, a hint and retryability.

Every adapter module translates its library's errors into these, so no
``psycopg.errors``, ``nats.errors`` or ``grpc.RpcError`` escapes it. The kind
decides the gRPC status; the code is the stable, domain-specific name.
"""

from __future__ import annotations

from enum import Enum
from typing import ClassVar

import grpc

from parley.v1 import common_pb2


class Kind(Enum):
    INVALID_ARGUMENT = common_pb2.ERROR_KIND_INVALID_ARGUMENT
    NOT_FOUND = common_pb2.ERROR_KIND_NOT_FOUND
    CONFLICT = common_pb2.ERROR_KIND_CONFLICT
    FAILED_PRECONDITION = common_pb2.ERROR_KIND_FAILED_PRECONDITION
    RESOURCE_EXHAUSTED = common_pb2.ERROR_KIND_RESOURCE_EXHAUSTED
    UNAUTHENTICATED = common_pb2.ERROR_KIND_UNAUTHENTICATED
    PERMISSION_DENIED = common_pb2.ERROR_KIND_PERMISSION_DENIED
    UNAVAILABLE = common_pb2.ERROR_KIND_UNAVAILABLE
    DEADLINE_EXCEEDED = common_pb2.ERROR_KIND_DEADLINE_EXCEEDED
    INTERNAL = common_pb2.ERROR_KIND_INTERNAL


GRPC_STATUS: dict[Kind, grpc.StatusCode] = {
    Kind.INVALID_ARGUMENT: grpc.StatusCode.INVALID_ARGUMENT,
    Kind.NOT_FOUND: grpc.StatusCode.NOT_FOUND,
    Kind.CONFLICT: grpc.StatusCode.ABORTED,
    Kind.FAILED_PRECONDITION: grpc.StatusCode.FAILED_PRECONDITION,
    Kind.RESOURCE_EXHAUSTED: grpc.StatusCode.RESOURCE_EXHAUSTED,
    Kind.UNAUTHENTICATED: grpc.StatusCode.UNAUTHENTICATED,
    Kind.PERMISSION_DENIED: grpc.StatusCode.PERMISSION_DENIED,
    Kind.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
    Kind.DEADLINE_EXCEEDED: grpc.StatusCode.DEADLINE_EXCEEDED,
    Kind.INTERNAL: grpc.StatusCode.INTERNAL,
}
KIND_OF_STATUS = {status: kind for kind, status in GRPC_STATUS.items()}


class ParleyError(Exception):
    """Base of every error a Parley caller can act on."""

    kind: ClassVar[Kind] = Kind.INTERNAL
    default_code: ClassVar[str] = "INTERNAL"
    retryable: ClassVar[bool] = False

    def __init__(
        self, message: str, *, code: str | None = None, hint: str = "", retryable: bool | None = None
    ) -> None:
        super().__init__(message)
        self.message = message
        self.code = code or self.default_code
        self.hint = hint
        if retryable is not None:
            self.retryable = retryable  # type: ignore[misc]

    def __str__(self) -> str:
        return f"{self.code}: {self.message}" + (f" ({self.hint})" if self.hint else "")

    @property
    def grpc_status(self) -> grpc.StatusCode:
        return GRPC_STATUS[self.kind]

    def to_proto(self) -> common_pb2.Error:
        return common_pb2.Error(
            code=self.code,
            message=self.message,
            hint=self.hint,
            retryable=self.retryable,
            kind=self.kind.value,
        )

    @staticmethod
    def from_proto(envelope: common_pb2.Error) -> ParleyError:
        try:
            kind = Kind(envelope.kind)
        except ValueError:
            kind = Kind.INTERNAL
        cls = _CLASS_OF_KIND.get(kind, ParleyError)
        return cls(
            envelope.message, code=envelope.code or None, hint=envelope.hint, retryable=envelope.retryable
        )


class InvalidArgument(ParleyError):
    kind = Kind.INVALID_ARGUMENT
    default_code = "INVALID_ARGUMENT"


class NotFound(ParleyError):
    kind = Kind.NOT_FOUND
    default_code = "NOT_FOUND"


class Conflict(ParleyError):
    kind = Kind.CONFLICT
    default_code = "CONFLICT"


class FailedPrecondition(ParleyError):
    kind = Kind.FAILED_PRECONDITION
    default_code = "FAILED_PRECONDITION"


class ResourceExhausted(ParleyError):
    kind = Kind.RESOURCE_EXHAUSTED
    default_code = "RESOURCE_EXHAUSTED"
    retryable = True


class Unauthenticated(ParleyError):
    kind = Kind.UNAUTHENTICATED
    default_code = "UNAUTHENTICATED"


class PermissionDenied(ParleyError):
    kind = Kind.PERMISSION_DENIED
    default_code = "PERMISSION_DENIED"


class Unavailable(ParleyError):
    kind = Kind.UNAVAILABLE
    default_code = "UNAVAILABLE"
    retryable = True


class DeadlineExceeded(ParleyError):
    kind = Kind.DEADLINE_EXCEEDED
    default_code = "DEADLINE_EXCEEDED"
    retryable = True


class Internal(ParleyError):
    kind = Kind.INTERNAL
    default_code = "INTERNAL"


_CLASS_OF_KIND: dict[Kind, type[ParleyError]] = {
    cls.kind: cls
    for cls in (
        InvalidArgument,
        NotFound,
        Conflict,
        FailedPrecondition,
        ResourceExhausted,
        Unauthenticated,
        PermissionDenied,
        Unavailable,
        DeadlineExceeded,
        Internal,
    )
}
