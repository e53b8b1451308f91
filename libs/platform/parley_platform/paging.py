"""Offset pages: limit 1–100 (default 50), offset ≥ 0, validated before any read.

``page_of`` reads a ``PageRequest``; ``page_bounds`` validates whatever a caller sent (an int
from protobuf, a string from the command line, any JSON value) with an error naming the field.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar

from parley.v1 import common_pb2

from . import codes

DEFAULT_LIMIT = 50
MAX_LIMIT = 100
T = TypeVar("T")
MAX_OFFSET = 2**63 - 1  # the wire's int64 and SQL's bigint
_INTEGER = re.compile(r"[+-]?[0-9]+")


def _integer(value: object, field: str, requirement: str) -> int:
    # bool is an int in Python, and 1.0 or "1.5" are not integers the caller meant.
    if isinstance(value, bool):
        raise codes.INVALID_PAGE(f"{field} must be {requirement}, got a boolean")
    if isinstance(value, int):
        return value
    if isinstance(value, str) and _INTEGER.fullmatch(value.strip()):
        return int(value.strip())
    shown = (
        repr(value)
        if isinstance(value, int | float | str) and len(repr(value)) <= 40
        else type(value).__name__
    )
    raise codes.INVALID_PAGE(f"{field} must be {requirement}, got {shown}")


def page_bounds(limit: object = None, offset: object = None) -> tuple[int, int]:
    """(limit, offset) of a pairing page: limit 1–100 (None: 50), offset ≥ 0 (None: 0), both integers."""
    limit_requirement = f"an integer from 1 to {MAX_LIMIT}"
    checked_limit = DEFAULT_LIMIT if limit is None else _integer(limit, "limit", limit_requirement)
    if not 1 <= checked_limit <= MAX_LIMIT:
        raise codes.INVALID_PAGE(f"limit must be {limit_requirement}, got {checked_limit}")
    checked_offset = 0 if offset is None else _integer(offset, "offset", "an integer of 0 or more")
    if checked_offset < 0:
        raise codes.INVALID_PAGE(f"offset must be an integer of 0 or more, got {checked_offset}")
    if checked_offset > MAX_OFFSET:
        raise codes.INVALID_PAGE(f"offset must be at most {MAX_OFFSET}, got {checked_offset}")
    return checked_limit, checked_offset


@dataclass(frozen=True)
class Page:
    limit: int
    offset: int

    @property
    def fetch(self) -> int:
        """Rows to ask the database for: one extra tells whether there is a next page."""
        return self.limit + 1


def page_of(request: common_pb2.PageRequest | None) -> Page:
    if request is None:
        return Page(DEFAULT_LIMIT, 0)
    limit = request.limit or DEFAULT_LIMIT
    if not 1 <= limit <= MAX_LIMIT:
        raise codes.INVALID_PAGE(f"page.limit must be an integer from 1 to {MAX_LIMIT}, got {request.limit}")
    if request.offset < 0:
        raise codes.INVALID_PAGE(f"page.offset must be 0 or more, got {request.offset}")
    return Page(limit, request.offset)


def cut(page: Page, rows: Sequence[T]) -> tuple[list[T], common_pb2.PageResponse]:
    has_more = len(rows) > page.limit
    response = common_pb2.PageResponse(limit=page.limit, offset=page.offset, has_more=has_more)
    if has_more:
        response.next_offset = page.offset + page.limit
    return list(rows[: page.limit]), response
