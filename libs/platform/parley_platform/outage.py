"""Outages are not poison: which failures mean "something else is down", and waiting them out.

A consumer's handler can fail three ways, and each is handled differently
(``parley_platform.consumer``):

- the message is poison (it cannot be decoded or validated): dead-lettered at once;
- the message's own handling failed: redelivered with backoff, dead-lettered after
  ``max_deliver`` deliveries;
- a dependency is unavailable (``outage_of`` names it): the message is *held* — heartbeated,
  neither acked nor nak'ed, so no delivery is spent — while the consumer stops fetching. One
  held message per backoff interval (0.5 s doubling to ``probe_cap``) retries as the probe; the
  first retry that gets past the dependency marks it back and every held message retries.

``Dependencies`` keeps which dependencies are down, the ``parley_dependency_up`` gauge (an alert
rule in ``deploy/prometheus/alerts.yml`` names the missing one) and tells the host, which reports
NOT_SERVING on its gRPC health endpoint meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge

from .errors import Kind, ParleyError
from .logging import get_logger
from .retry import Backoff

log = get_logger(__name__)

# Local failures that say which piece of infrastructure is away. A service called over NATS is
# named by the RPC client (``ParleyError.dependency``), see ``mark_remote``.
OUTAGE_CODES = {
    "DB_UNAVAILABLE": "postgres",
    "DB_POOL_EXHAUSTED": "postgres",
    "NATS_UNAVAILABLE": "nats",
    "JETSTREAM_UNAVAILABLE": "nats",
}


def outage_of(exc: BaseException) -> str | None:
    """The dependency whose unavailability made ``exc``, or None when the failure is the message's own."""
    if not isinstance(exc, ParleyError):
        return None
    return exc.dependency or OUTAGE_CODES.get(exc.code)


def mark_remote(exc: ParleyError, service: str) -> ParleyError:
    """Name ``service`` as the missing dependency when a call to it failed because it (or what it
    needs) is away: nobody listens (NO_RESPONDERS), or it answered UNAVAILABLE (its database, its
    model provider's open circuit) or a retryable RESOURCE_EXHAUSTED (rate-limited, saturated).
    A timeout is not an outage: a request can be slow on its own, and its retries are bounded."""
    if exc.dependency is None and (
        exc.code == "NO_RESPONDERS"
        or (exc.kind is Kind.UNAVAILABLE and exc.code not in ("NATS_UNAVAILABLE", "JETSTREAM_UNAVAILABLE"))
        or (exc.kind is Kind.RESOURCE_EXHAUSTED and exc.retryable)
    ):
        exc.dependency = service
    return exc


class DependencyMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.up = Gauge(
            "parley_dependency_up",
            "1 while the dependency answers, 0 while messages wait for it",
            ["dependency"],
            registry=registry,
        )
        self.outages = Counter(
            "parley_dependency_outages_total",
            "Times a dependency was found down",
            ["dependency"],
            registry=registry,
        )
        self.held = Gauge(
            "parley_messages_held",
            "Messages held (not fetched again, no delivery spent) until a dependency is back",
            ["stream"],
            registry=registry,
        )


@dataclass
class _Down:
    reason: str
    since: float = field(default_factory=time.monotonic)
    back: asyncio.Event = field(default_factory=asyncio.Event)
    next_probe: float = 0.0
    probes: int = 0
    holders: int = 0
    released: float = field(default_factory=time.monotonic)  # when a holder last stopped waiting
    probed: bool = False  # a probe of the host's watches it (postgres, nats): it says when it is back


Heartbeat = Callable[[], Awaitable[None]]


class Dependencies:
    """Which dependencies of one process are down; shared by its consumers and its health endpoint."""

    def __init__(
        self,
        registry: CollectorRegistry | None = None,
        *,
        known: Iterable[str] = (),
        probe_base: float = 0.5,
        probe_cap: float = 5.0,
    ) -> None:
        self.metrics = DependencyMetrics(registry) if registry is not None else None
        self.backoff = Backoff(probe_base, probe_cap)
        self._down: dict[str, _Down] = {}
        self._listeners: list[Callable[[list[str]], None]] = []
        self._all_up = asyncio.Event()
        self._all_up.set()
        for name in known:
            self._gauge(name, 1)

    def _gauge(self, name: str, value: int) -> None:
        if self.metrics is not None:
            self.metrics.up.labels(name).set(value)

    def listen(self, listener: Callable[[list[str]], None]) -> None:
        """``listener(missing)`` after every change (the host sets its health status)."""
        self._listeners.append(listener)

    def _changed(self) -> None:
        missing = self.missing()
        if missing:
            self._all_up.clear()
        else:
            self._all_up.set()
        for listener in self._listeners:
            listener(missing)

    def missing(self) -> list[str]:
        return sorted(self._down)

    def is_down(self, name: str) -> bool:
        return name in self._down

    def down(self, name: str, reason: str, *, probed: bool = False) -> None:
        if name in self._down:
            self._down[name].reason = reason
            self._down[name].probed |= probed
            return
        state = _Down(reason, probed=probed)
        state.next_probe = state.since + self.backoff.delay(1)
        state.probes = 1
        self._down[name] = state
        self._gauge(name, 0)
        if self.metrics is not None:
            self.metrics.outages.labels(name).inc()
        log.error("dependency unavailable; holding messages until it is back", dependency=name, reason=reason)
        self._changed()

    def up(self, name: str, how: str = "answered") -> None:
        state = self._down.pop(name, None)
        if state is None:
            return
        state.back.set()
        self._gauge(name, 1)
        log.warning(
            "dependency back",
            dependency=name,
            how=how,
            outage_seconds=round(time.monotonic() - state.since, 1),
        )
        self._changed()

    async def hold(self, name: str, heartbeat: Heartbeat, interval: float) -> None:
        """Wait until a held message should retry: ``name`` is back, or this holder is the probe of
        this backoff interval. ``heartbeat`` runs every ``interval`` seconds meanwhile."""
        state = self._down.get(name)
        if state is None:
            return
        state.holders += 1
        try:
            while not state.back.is_set():
                now = time.monotonic()
                if now >= state.next_probe:
                    state.probes += 1
                    state.next_probe = now + self.backoff.delay(state.probes)
                    return
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(state.back.wait(), min(interval, state.next_probe - now))
                await heartbeat()
        finally:
            state.holders -= 1
            state.released = time.monotonic()

    async def wait_all_up(self, timeout: float) -> bool:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._all_up.wait(), timeout)
        return self._all_up.is_set()

    def unheld(self, *, after: float) -> None:
        """A dependency no message has waited on for ``after`` seconds (its held messages finished
        or were stopped) is not known to be down: forget it, so a paused consumer fetches again
        (and the next failure marks it down again)."""
        now = time.monotonic()
        for name, state in list(self._down.items()):
            if not state.probed and state.holders == 0 and now - state.released >= after:
                self.up(name, how="no message waits on it")
