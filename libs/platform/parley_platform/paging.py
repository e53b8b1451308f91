"""Offset pages: limit 1–100 (default 50), offset ≥ 0, validated before any read."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar

from parley.v1 import common_pb2

from .errors import InvalidArgument

DEFAULT_LIMIT = 50
MAX_LIMIT = 100
T = TypeVar("T")


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
        raise InvalidArgument(
            f"page.limit must be an integer from 1 to {MAX_LIMIT}, got {request.limit}", code="INVALID_PAGE"
        )
    if request.offset < 0:
        raise InvalidArgument(f"page.offset must be 0 or more, got {request.offset}", code="INVALID_PAGE")
    return Page(limit, request.offset)


def cut(page: Page, rows: Sequence[T]) -> tuple[list[T], common_pb2.PageResponse]:
    has_more = len(rows) > page.limit
    response = common_pb2.PageResponse(limit=page.limit, offset=page.offset, has_more=has_more)
    if has_more:
        response.next_offset = page.offset + page.limit
    return list(rows[: page.limit]), response
