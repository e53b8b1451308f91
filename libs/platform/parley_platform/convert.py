"""Conversions between the wire (protobuf) and Python values, once for every service."""

from __future__ import annotations

import math
import time
import uuid
from datetime import UTC, datetime

from google.protobuf.timestamp_pb2 import Timestamp

from . import codes


def timestamp(value: datetime | None) -> Timestamp | None:
    """A protobuf Timestamp of an aware datetime (None stays None).

    Twice as fast as ``Timestamp.FromDatetime``, which goes through time tuples; exact, since a
    double holds today's epoch seconds to well under a microsecond."""
    if value is None:
        return None
    return Timestamp(seconds=math.floor(value.timestamp()), nanos=value.microsecond * 1000)


def set_timestamp(stamp: Timestamp, value: datetime | None) -> None:
    """Sets a message's Timestamp field to an aware datetime; None leaves it unset.

    Half the cost of passing ``timestamp(value)`` to the message's constructor, which builds a
    Timestamp and then copies it into the message (2.3 against 5.3 µs for five fields)."""
    if value is not None:
        stamp.seconds = math.floor(value.timestamp())
        stamp.nanos = value.microsecond * 1000


def set_now(stamp: Timestamp) -> Timestamp:
    """Sets a Timestamp to now and returns it. ``Timestamp.GetCurrentTime`` goes through a datetime
    and time tuples: about 2 µs, called several times in every turn; this is two assignments."""
    stamp.seconds, stamp.nanos = divmod(time.time_ns(), 1_000_000_000)
    return stamp


def datetime_of(value: Timestamp) -> datetime | None:
    """The aware datetime of a Timestamp; the unset (zero) Timestamp is None."""
    if value.seconds == 0 and value.nanos == 0:
        return None
    return value.ToDatetime(tzinfo=UTC)


def uuid_of(value: str, field: str) -> uuid.UUID:
    """A UUID field of a request; anything else is INVALID_ID naming the field, never the value
    (a secret pasted into the wrong field must not come back in an error)."""
    try:
        return uuid.UUID(value)
    except (ValueError, TypeError, AttributeError):
        raise codes.INVALID_ID(f"{field} must be a UUID") from None


def uuid_or_none(value: str) -> uuid.UUID | None:
    try:
        return uuid.UUID(value)
    except (ValueError, TypeError, AttributeError):
        return None
