"""The platform's loop-owned metrics (``LoopCounter``, ``LoopGauge``, ``LoopHistogram``,
``GaugeFunctions``): a scrape reads exactly what prometheus_client's own counters, gauges and
histograms would show for the same updates, so dashboards and alerts cannot tell them apart."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from parley_platform.metrics import LATENCY_BUCKETS, GaugeFunctions, LoopCounter, LoopGauge, LoopHistogram


def exposition(registry: CollectorRegistry) -> list[str]:
    """The scrape's samples, without ``_created`` (prometheus_client's own; not read by deploy/)."""
    lines = generate_latest(registry).decode().splitlines()
    return [line for line in lines if line and not line.startswith("#") and "_created" not in line]


def test_counters_and_histograms_scrape_as_prometheus_clients_own() -> None:
    theirs, ours = CollectorRegistry(), CollectorRegistry()
    their_time = Histogram("t_seconds", "time", ["a"], buckets=LATENCY_BUCKETS, registry=theirs)
    our_time = LoopHistogram("t_seconds", "time", ["a"], ours, buckets=LATENCY_BUCKETS)
    their_count = Counter("c_total", "count", ["a", "b"], registry=theirs)
    our_count = LoopCounter("c_total", "count", ["a", "b"], ours)
    # Values on bucket bounds (le is inclusive), between them, below the first and above the last.
    for value in (0.0, 0.0005, 0.0007, 0.001, 0.3, 10, 30, 31, 1e6):
        their_time.labels("x").observe(value)
        our_time.labels("x").observe(value)
    their_time.labels("y").observe(0.01)
    our_time.labels("y").observe(0.01)
    for labels, amount in ((("u", "v"), 1), (("u", "v"), 2.5), (("w", "z"), 7)):
        their_count.labels(*labels).inc(amount)
        our_count.labels(*labels).inc(amount)
    assert exposition(ours) == exposition(theirs)
    help_and_type = [line for line in generate_latest(ours).decode().splitlines() if line.startswith("#")]
    assert "# TYPE c_total counter" in help_and_type
    assert "# TYPE t_seconds histogram" in help_and_type


def test_gauges_scrape_as_prometheus_clients_own() -> None:
    theirs, ours = CollectorRegistry(), CollectorRegistry()
    their_level = Gauge("g_inflight", "in flight", ["stream"], registry=theirs)
    our_level = LoopGauge("g_inflight", "in flight", ["stream"], ours)
    for stream, change in (("a", 1), ("a", 1), ("b", 3), ("a", -1), ("b", -3), ("c", 0.5)):
        for level in (their_level, our_level):
            child = level.labels(stream)
            child.inc(change) if change > 0 else child.dec(-change)
    assert exposition(ours) == exposition(theirs)
    assert "# TYPE g_inflight gauge" in generate_latest(ours).decode()


def test_a_child_is_found_once_and_needs_every_label() -> None:
    counter = LoopCounter("c_total", "count", ["a", "b"], CollectorRegistry())
    assert counter.labels("x", "y") is counter.labels("x", "y")
    with pytest.raises(ValueError, match="takes the labels"):
        counter.labels("x")


def test_a_name_registered_twice_is_refused_like_prometheus_clients() -> None:
    registry = CollectorRegistry()
    LoopCounter("c_total", "count", ["a"], registry)
    with pytest.raises(ValueError, match="Duplicated"):
        Counter("c_total", "count", ["a"], registry=registry)


def test_gauge_functions_read_the_values_when_scraped() -> None:
    registry = CollectorRegistry()
    values = {("openai",): 2.0}
    GaugeFunctions("g_inflight", "in flight", ["provider"], lambda: dict(values), registry)
    assert exposition(registry) == ['g_inflight{provider="openai"} 2.0']
    values[("openai",)] = 0.0
    values[("local",)] = 1.0
    assert exposition(registry) == ['g_inflight{provider="openai"} 0.0', 'g_inflight{provider="local"} 1.0']
