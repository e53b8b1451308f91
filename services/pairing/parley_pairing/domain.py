"""Pure rules of pairing: codes, identifiers, metadata, pages. No I/O."""

from __future__ import annotations

import re
import secrets
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Generic, TypeVar

from parley_platform.errors import InvalidArgument
from parley_platform.paging import page_bounds

# The spec's alphabet: no 0/O or 1/I, so a code read aloud or typed from a screenshot is unambiguous.
ALPHABET = "ABCDEFGHJKLMNPQRSTUVWXYZ23456789"
CODE_LENGTH = 8
_CODE = re.compile(f"[{ALPHABET}]{{{CODE_LENGTH}}}")
_CHANNEL = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:-]{0,63}")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
MAX_ID_LENGTH = 256
MAX_METADATA_ENTRIES = 32
MAX_METADATA_KEY = 64
MAX_METADATA_VALUE = 1024
DEFAULT_ACTOR = "operator"

T = TypeVar("T")


def new_code(length: int = CODE_LENGTH, alphabet: str = ALPHABET) -> str:
    """A code drawn from the OS CSPRNG, uniform over the alphabet by rejection sampling.

    Bytes at or above the largest multiple of the alphabet's size are drawn
    again, so no character is more likely than another (with 32 characters
    none is ever rejected, but the rule holds for any alphabet).
    """
    size = len(alphabet)
    if not 1 < size <= 256:
        raise ValueError("the alphabet must have 2 to 256 characters")
    ceiling = 256 - 256 % size
    chosen: list[str] = []
    while len(chosen) < length:
        for byte in secrets.token_bytes(length - len(chosen)):
            if byte < ceiling:
                chosen.append(alphabet[byte % size])
    return "".join(chosen)


def normalize_code(raw: str) -> str:
    """What an operator typed, as a code: spaces anywhere removed, upper-cased."""
    code = "".join(raw.split()).upper()
    if not code:
        raise InvalidArgument("code is required", code="CODE_REQUIRED")
    if not _CODE.fullmatch(code):
        # The code is not echoed: it is what admits a sender.
        raise InvalidArgument(
            f"code must be {CODE_LENGTH} characters from {ALPHABET}",
            code="INVALID_CODE",
            hint="copy it from the pairing reply or `parley pairing list <channel>`",
        )
    return code


def agent_uuid(value: str) -> uuid.UUID:
    if not value:
        raise InvalidArgument("agent_id is required", code="AGENT_REQUIRED")
    try:
        return uuid.UUID(value)
    except ValueError:
        raise InvalidArgument(
            "agent_id must be the agent's UUID",
            code="INVALID_AGENT_ID",
            hint="list them with `parley agents`",
        ) from None


def channel_name(value: str) -> str:
    if not value:
        raise InvalidArgument("channel is required (the connector, e.g. discord)", code="CHANNEL_REQUIRED")
    if not _CHANNEL.fullmatch(value):
        raise InvalidArgument(
            "channel must be 1 to 64 letters, digits or _ . : - and start with a letter or digit",
            code="INVALID_CHANNEL",
        )
    return value


def text_id(value: str, field_name: str) -> str:
    if not value.strip():
        raise InvalidArgument(f"{field_name} is required", code="INVALID_ID")
    if len(value) > MAX_ID_LENGTH or _CONTROL.search(value):
        raise InvalidArgument(
            f"{field_name} must be at most {MAX_ID_LENGTH} characters without control characters",
            code="INVALID_ID",
        )
    return value


def actor(value: str, field_name: str) -> str:
    return text_id(value, field_name) if value else DEFAULT_ACTOR


def metadata(values: Mapping[str, str], field_name: str = "metadata") -> dict[str, str]:
    if len(values) > MAX_METADATA_ENTRIES:
        raise InvalidArgument(
            f"{field_name} may have at most {MAX_METADATA_ENTRIES} entries", code="INVALID_METADATA"
        )
    for key, value in values.items():
        if not key or len(key) > MAX_METADATA_KEY or _CONTROL.search(key):
            raise InvalidArgument(
                f"{field_name} keys must be 1 to {MAX_METADATA_KEY} characters without control characters",
                code="INVALID_METADATA",
            )
        if len(value) > MAX_METADATA_VALUE or "\x00" in value:
            raise InvalidArgument(
                f"{field_name}[{key!r}] must be at most {MAX_METADATA_VALUE} characters without NUL",
                code="INVALID_METADATA",
            )
    return dict(values)


@dataclass(frozen=True)
class Page:
    limit: int
    offset: int

    @classmethod
    def of(cls, limit: object, offset: object) -> Page:
        return cls(*page_bounds(limit, offset))

    @property
    def fetch(self) -> int:
        """Rows to read: one more than the limit tells whether there is a next page."""
        return self.limit + 1


@dataclass(frozen=True)
class PageOf(Generic[T]):
    items: list[T]
    limit: int
    offset: int
    has_more: bool
    next_offset: int | None


def cut(page: Page, rows: Sequence[T]) -> PageOf[T]:
    has_more = len(rows) > page.limit
    return PageOf(
        items=list(rows[: page.limit]),
        limit=page.limit,
        offset=page.offset,
        has_more=has_more,
        next_offset=page.offset + page.limit if has_more else None,
    )


@dataclass(frozen=True)
class PendingRequest:
    id: uuid.UUID
    agent_id: uuid.UUID
    channel: str
    sender_id: str
    code: str
    created_at: datetime
    last_seen_at: datetime
    expires_at: datetime
    metadata: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class AllowEntry:
    id: uuid.UUID
    agent_id: uuid.UUID
    channel: str
    sender_id: str
    created_at: datetime
    added_by: str
    metadata: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Upserted:
    outcome: str  # created, existing, full
    request: PendingRequest | None
