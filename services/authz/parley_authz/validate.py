"""Field checks at the edge: a request's strings and numbers, before any statement runs.

A field of a contract document or request (``contract=True``) is refused with
INVALID_CONTRACT, any other with INVALID_ARGUMENT. Errors name fields and never echo
values: ids, digests and opaque account data can be sensitive, and a refused request is
no place to reflect them.
"""

from __future__ import annotations

import re
import uuid

from parley_platform import codes
from parley_platform.canonical import InvalidContract
from parley_platform.convert import uuid_or_none
from parley_platform.errors import ParleyError

MAX_ID = 200
MAX_TEXT = 2000
MAX_GENERATION = 2**63 - 1

_HEX64 = re.compile(r"[0-9a-f]{64}")
_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_.:-]{0,127}")
_RESOURCE_KIND = re.compile(r"[a-z][a-z0-9_-]{0,31}")
_CODE = re.compile(r"[a-z][a-z0-9_]{0,63}")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def invalid(message: str, *, contract: bool) -> ParleyError:
    """A refused field: INVALID_CONTRACT in a contract document or request, else INVALID_ARGUMENT."""
    return InvalidContract(message) if contract else codes.INVALID_ARGUMENT(message)


def agent_uuid(value: str, *, field: str = "agent_id", contract: bool = False) -> uuid.UUID:
    if not value:
        raise invalid(f"{field} is required (the agent's UUID)", contract=contract)
    parsed = uuid_or_none(value)
    if parsed is None:
        raise invalid(f"{field} must be a UUID", contract=contract)
    return parsed


def opaque_id(value: str, field: str, *, contract: bool = False, required: bool = True) -> str:
    """An id chosen by the caller: 1–200 characters, no control characters."""
    if not value:
        if required:
            raise invalid(f"{field} is required", contract=contract)
        return value
    if len(value) > MAX_ID or _CONTROL.search(value):
        raise invalid(
            f"{field} must be 1 to {MAX_ID} characters without control characters", contract=contract
        )
    return value


def hex_digest(value: str, field: str, *, contract: bool = True) -> str:
    if not _HEX64.fullmatch(value):
        raise invalid(
            f"{field} must be a SHA-256 digest: 64 lowercase hexadecimal characters", contract=contract
        )
    return value


def name(value: str, field: str, *, contract: bool = False) -> str:
    if not _NAME.fullmatch(value):
        raise invalid(
            f"{field} must start with a letter and use letters, digits and _ . : - (at most 128 characters)",
            contract=contract,
        )
    return value


def code(value: str, field: str) -> str:
    if not _CODE.fullmatch(value):
        raise InvalidContract(f"{field} must be a lower_snake_case code of at most 64 characters")
    return value


def text(value: str, field: str, *, limit: int = MAX_TEXT) -> str:
    if len(value) > limit:
        raise codes.INVALID_ARGUMENT(f"{field} must be at most {limit} characters")
    if "\x00" in value:  # PostgreSQL's text cannot hold it
        raise codes.INVALID_ARGUMENT(f"{field} must not contain NUL characters")
    return value


def resource_kind(value: str, field: str = "resource.kind") -> str:
    if not _RESOURCE_KIND.fullmatch(value):
        raise codes.INVALID_ARGUMENT(
            f"{field} must be a lower-case name such as keyboard, pointer, clipboard or browser"
        )
    return value


def ttl_ms(value: int, field: str, *, maximum: int) -> int:
    if not 1 <= value <= maximum:
        raise codes.INVALID_ARGUMENT(f"{field} must be from 1 to {maximum} milliseconds")
    return value


def generation(value: int, field: str = "generation") -> int:
    if value > MAX_GENERATION:
        raise codes.INVALID_ARGUMENT(f"{field} must be at most 2^63-1")
    return value
