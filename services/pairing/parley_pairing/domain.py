"""Pure rules of pairing: codes, identifiers, metadata, and the typed requests and entries. No I/O."""

from __future__ import annotations

import re
import secrets
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from enum import StrEnum

from parley_platform import codes

from . import errors

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
        raise errors.CODE_REQUIRED("code is required")
    if not _CODE.fullmatch(code):
        # The code is not echoed: it is what admits a sender.
        raise errors.INVALID_CODE(f"code must be {CODE_LENGTH} characters from {ALPHABET}")
    return code


def agent_uuid(value: str) -> uuid.UUID:
    if not value:
        raise errors.AGENT_REQUIRED("agent_id is required")
    try:
        return uuid.UUID(value)
    except ValueError:
        raise errors.INVALID_AGENT_ID("agent_id must be the agent's UUID") from None


def channel_name(value: str) -> str:
    if not value:
        raise errors.CHANNEL_REQUIRED("channel is required (the connector, e.g. discord)")
    if not _CHANNEL.fullmatch(value):
        raise errors.INVALID_CHANNEL(
            "channel must be 1 to 64 letters, digits or _ . : - and start with a letter or digit"
        )
    return value


def text_id(value: str, field_name: str) -> str:
    if not value.strip():
        raise codes.INVALID_ID(f"{field_name} is required")
    if len(value) > MAX_ID_LENGTH or _CONTROL.search(value):
        raise codes.INVALID_ID(
            f"{field_name} must be at most {MAX_ID_LENGTH} characters without control characters"
        )
    return value


def actor(value: str, field_name: str) -> str:
    return text_id(value, field_name) if value else DEFAULT_ACTOR


def metadata(values: Mapping[str, str], field_name: str = "metadata") -> dict[str, str]:
    if len(values) > MAX_METADATA_ENTRIES:
        raise errors.INVALID_METADATA(f"{field_name} may have at most {MAX_METADATA_ENTRIES} entries")
    for key, value in values.items():
        if not key or len(key) > MAX_METADATA_KEY or _CONTROL.search(key):
            raise errors.INVALID_METADATA(
                f"{field_name} keys must be 1 to {MAX_METADATA_KEY} characters without control characters"
            )
        if len(value) > MAX_METADATA_VALUE or "\x00" in value:
            raise errors.INVALID_METADATA(
                f"{field_name}[{key!r}] must be at most {MAX_METADATA_VALUE} characters without NUL"
            )
    return dict(values)


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


@dataclass(frozen=True, slots=True)
class RequestListing:
    """A pending request as a page lists it, in the form the page statement returns: the id as
    text, instants in microseconds since the epoch, no metadata as None. A page holds up to 1000 of
    them, and conversions per field would cost more than the statement (docs/performance.md)."""

    id: str
    sender_id: str
    code: str
    created_us: int
    last_seen_us: int
    expires_us: int
    metadata: dict[str, str] | None


@dataclass(frozen=True, slots=True)
class EntryListing:
    """An allowlist entry as a page lists it (see ``RequestListing``)."""

    id: str
    sender_id: str
    added_by: str
    created_us: int
    metadata: dict[str, str] | None


class UpsertOutcome(StrEnum):
    CREATED = "created"  # a new pending request, with a new code
    EXISTING = "existing"  # the sender's live request, seen again
    FULL = "full"  # the channel has max_pending live requests: no code for this sender


@dataclass(frozen=True)
class Upserted:
    outcome: UpsertOutcome
    request: PendingRequest | None
