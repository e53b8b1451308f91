"""One exception root for Parley, with a stable code, a hint and retryability.

Every adapter module translates its library's errors into these, so no
``psycopg.errors``, ``nats.errors`` or ``grpc.RpcError`` escapes it. The kind
decides the gRPC status; the code is the stable, domain-specific name.

Codes are declared once, in a ``Catalog`` per service (``parley_<service>/errors.py``,
the platform's own in ``parley_platform/codes.py``) with their kind, meaning, hint and
retryability; a raise site calls the entry: ``raise errors.AGENT_NOT_FOUND(f"no agent {name}")``.
``docs/errors.md`` is generated from the catalogs (``tools/gen_errors.py``).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
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
    # The unavailable dependency (a service's NATS name, "postgres", "nats") when the failure is
    # that something else is down rather than this request being wrong (parley_platform.outage).
    dependency: str | None = None

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


@dataclass(frozen=True)
class ErrorCode:
    """One entry of a catalog: calling it makes the error to raise."""

    code: str
    kind: Kind
    meaning: str
    hint: str = ""
    retryable: bool | None = None  # None: the kind decides (UNAVAILABLE, RESOURCE_EXHAUSTED, ...)
    catalog: str = ""

    def __call__(self, message: str, *, hint: str | None = None) -> ParleyError:
        return _CLASS_OF_KIND[self.kind](
            message, code=self.code, hint=self.hint if hint is None else hint, retryable=self.retryable
        )

    @property
    def is_retryable(self) -> bool:
        return _CLASS_OF_KIND[self.kind].retryable if self.retryable is None else self.retryable

    def matches(self, exc: BaseException) -> bool:
        return isinstance(exc, ParleyError) and exc.code == self.code


class Catalog:
    """The error codes of one service; a code is declared once, with one kind."""

    def __init__(self, name: str, description: str) -> None:
        self.name = name
        self.description = description
        self._codes: dict[str, ErrorCode] = {}

    def define(
        self, code: str, kind: Kind, meaning: str, *, hint: str = "", retryable: bool | None = None
    ) -> ErrorCode:
        if code in self._codes:
            raise ValueError(f"error code {code} is declared twice in the {self.name} catalog")
        entry = ErrorCode(code, kind, meaning, hint, retryable, self.name)
        self._codes[code] = entry
        return entry

    def __iter__(self) -> Iterator[ErrorCode]:
        return iter(sorted(self._codes.values(), key=lambda e: e.code))

    def __contains__(self, code: object) -> bool:
        return code in self._codes

    def __getitem__(self, code: str) -> ErrorCode:
        return self._codes[code]
