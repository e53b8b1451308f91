"""What the gateway keeps in PostgreSQL, typed: budgets and their reservations, the usage ledger, the
batcher's drain claims and its status per affinity. ``store.py`` alone builds them from rows
(``from_row``); everything else reads attributes."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from datetime import datetime
from typing import Any, Self

from .batching import Section


class FromRow:
    """A record whose fields are the columns of the query that returns it, named and typed alike
    (the SQL casts and aliases so they are); a column the record lacks is not read."""

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> Self:
        return cls(**{f.name: row[f.name] for f in fields(cls)})  # type: ignore[arg-type]


@dataclass(frozen=True)
class Reservation(FromRow):
    """What reserving tokens against an agent's budget found: no budget, admitted, or refused."""

    budgeted: bool
    admitted: bool
    limit_tokens: int | None


@dataclass(frozen=True)
class Budget(FromRow):
    """An agent's token budget; ``spent_tokens`` is 0 once the window is over."""

    agent_id: str
    limit_tokens: int
    window_seconds: int
    window_started_at: datetime
    spent_tokens: int
    reserved_tokens: int


@dataclass(frozen=True)
class UsageIncrement:
    """Usage to add to the ledger under one key (agent, provider, model, model type, kind)."""

    agent_id: str
    provider: str
    model: str
    model_type: str
    kind: str
    requests: int
    input_tokens: int
    output_tokens: int
    cached_input_tokens: int


@dataclass(frozen=True)
class UsageTotal(FromRow):
    """The ledger's running total under one key, and when it was first and last added to."""

    agent_id: str
    provider: str
    model: str
    model_type: str
    kind: str
    requests: int
    input_tokens: int
    output_tokens: int
    cached_input_tokens: int
    first_at: datetime
    last_at: datetime


@dataclass(frozen=True)
class DrainClaim:
    """An affinity's drain lease, taken: the drain's sequence number, when it started, and the
    sections it claimed."""

    seq: int
    started_at: datetime
    sections: tuple[Section, ...]


@dataclass(frozen=True)
class AffinityStatus(FromRow):
    """The batcher's sections and drains of one affinity."""

    affinity: str
    pending: int
    sections: int  # not yet delivered
    min_cycle_ms: int | None  # the shortest cycle of its recurring sections, if it has any
    drains: int
    draining: bool
    last_drain_at: datetime | None
    since_last_drain_ms: int | None
