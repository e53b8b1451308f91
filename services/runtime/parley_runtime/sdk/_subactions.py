"""Sub-actions: one action with several operations (``NOTE`` with ``op: add | list``), picked by
the first dispatch key the planner sent."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, TypeVar

from parley_platform.errors import InvalidArgument

from .. import errors

SUBACTION_KEYS = ("action", "subaction", "op", "operation", "verb")
H = TypeVar("H")


class UnknownSubaction(InvalidArgument):
    """No sub-action, or one the action does not have: the planner's mistake, reported to it."""

    default_code = errors.UNKNOWN_SUBACTION.code


def normalise_subaction(value: str) -> str:
    snake = re.sub(r"(?<=[a-z0-9])([A-Z])", r"_\1", value.strip())
    return re.sub(r"[^a-z0-9]+", "_", snake.lower()).strip("_")


def dispatch_subaction(params: Mapping[str, Any], handlers: Mapping[str, H]) -> tuple[str, H]:
    """Pick a sub-action by the first dispatch key present (action, subaction, op, operation, verb)."""
    for key in SUBACTION_KEYS:
        value = params.get(key)
        if isinstance(value, str) and value.strip():
            name = normalise_subaction(value)
            if name in handlers:
                return name, handlers[name]
            raise UnknownSubaction(f"unknown sub-action {name!r}; known: {', '.join(sorted(handlers))}")
    raise UnknownSubaction(f"no sub-action given (one of {', '.join(SUBACTION_KEYS)})")
