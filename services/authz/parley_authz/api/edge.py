"""What every area of the authz API shares: its dependencies and the checks at the protobuf edge."""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import Any, TypeVar

from google.protobuf.message import Message
from google.protobuf.timestamp_pb2 import Timestamp

from parley_platform import codes

from .. import contracts
from ..events import Announcer
from ..metrics import AuthzMetrics
from ..model import ToolDecision
from ..store import AuthzStore

Req = TypeVar("Req", bound=Message)
Resp = TypeVar("Resp", bound=Message)


class Handlers:
    """The dependencies of every area's handlers; ``AuthzApi`` sets them."""

    store: AuthzStore
    metrics: AuthzMetrics
    announcer: Announcer | None
    expiry_decision: ToolDecision


def strict(method: Callable[[Any, Req], Awaitable[Resp]]) -> Callable[[Any, Req], Awaitable[Resp]]:
    """Refuse a request carrying fields this service does not know before anything else."""

    @functools.wraps(method)
    async def checked(self: Any, request: Req) -> Resp:
        contracts.check_known_fields(request)
        return await method(self, request)

    return checked


def now_ms() -> datetime:
    """This service's clock, to the millisecond (what enters canonical documents)."""
    return datetime.fromtimestamp(math.floor(time.time() * 1000) / 1000, tz=UTC)


def lenient_time(message: Message, name: str, field: str) -> datetime | None:
    """An optional timestamp that enters no digest: any precision."""
    if not message.HasField(name):
        return None
    ts: Timestamp = getattr(message, name)
    if not 0 <= ts.seconds <= contracts.MAX_TIMESTAMP_SECONDS:
        raise codes.INVALID_ARGUMENT(f"{field} must be between 1970 and 9999")
    # Not convert.datetime_of: a set field at the epoch itself is that instant, not "unset".
    return ts.ToDatetime(tzinfo=UTC)
