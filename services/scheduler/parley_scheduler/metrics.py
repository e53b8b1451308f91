"""The scheduler's Prometheus metrics. What every run updates is kept in loop-owned values
(``parley_platform.metrics.LoopCounter``): prometheus_client's locked children were a tenth of the
scheduler's samples under load (docs/performance.md)."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge

from parley_platform.metrics import LATENCY_BUCKETS, GaugeFunctions, LoopCounter, LoopHistogram

LAG_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)


class SchedulerMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.executed = LoopCounter(
            "parley_tasks_executed_total", "Task runs by worker and outcome", ["worker", "outcome"], registry
        )
        self.duration = LoopHistogram(
            "parley_task_duration_seconds",
            "Dispatch to reply of one run",
            ["worker"],
            registry,
            buckets=LATENCY_BUCKETS,
        )
        self.lag = LoopHistogram(
            "parley_task_lag_seconds", "From due to start of a run", [], registry, buckets=LAG_BUCKETS
        ).labels()
        self.due = Gauge("parley_tasks_due", "Queue tasks due and not yet claimed", registry=registry)
        self.paused = Counter(
            "parley_tasks_paused_total", "Tasks paused, by reason", ["reason"], registry=registry
        )
        self.conflicts = Counter(
            "parley_task_claim_conflicts_total",
            "Claims and completions that lost to another holder of the task",
            registry=registry,
        )
        self.lease_expired = Counter(
            "parley_task_lease_expired_total",
            "Runs whose lease expired and whose slot was claimed again",
            registry=registry,
        )
        self.overdue = Counter(
            "parley_tasks_overdue_total",
            "Repeat runs that started after their slot",
            ["worker"],
            registry=registry,
        )
        self._inflight: Callable[[], int] = lambda: 0
        GaugeFunctions(
            "parley_tasks_inflight",
            "Runs this replica is waiting on",
            [],
            lambda: {(): float(self._inflight())},
            registry,
        )

    def watch_inflight(self, count: Callable[[], int]) -> None:
        """``parley_tasks_inflight`` reads ``count()`` when scraped (no update per run)."""
        self._inflight = count
