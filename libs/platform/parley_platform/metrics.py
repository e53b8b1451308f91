"""Prometheus metrics: one registry per service, served on its own port."""

from __future__ import annotations

import bisect
import math
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from . import codes

LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


@dataclass
class MetricsServer:
    server: WSGIServer
    thread: threading.Thread

    @property
    def port(self) -> int:
        return int(self.server.server_port)

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)


def serve(registry: CollectorRegistry, host: str, port: int, *, port_setting: str = "") -> MetricsServer:
    try:
        server, thread = start_http_server(port, addr=host, registry=registry)
    except OSError as exc:
        raise codes.PORT_IN_USE(
            f"cannot serve metrics on {host}:{port}: {exc.strerror or exc}",
            hint=f"set {port_setting} to a free port" if port_setting else "choose a free metrics port",
        ) from exc
    return MetricsServer(server, thread)


class MessagingMetrics:
    """Metrics every consumer and RPC server records, after faststream's names."""

    def __init__(self, registry: CollectorRegistry) -> None:
        # Updated for every message and every request, by the event loop (see ``LoopCount``).
        self.received = LoopCounter(
            "parley_received_messages_total", "Messages received by consumers", ["stream"], registry
        )
        self.processed = LoopHistogram(
            "parley_processed_duration_seconds",
            "Time to handle one message",
            ["stream", "outcome"],
            registry,
            buckets=LATENCY_BUCKETS,
        )
        self.dead = LoopCounter(
            "parley_dead_letters_total",
            "Messages sent to the dead-letter stream",
            ["stream", "reason"],
            registry,
        )
        self.inflight = LoopGauge(
            "parley_messages_inflight", "Messages being handled now", ["stream"], registry
        )
        self.rpc = LoopHistogram(
            "parley_rpc_duration_seconds",
            "NATS RPC handling time",
            ["method", "outcome"],
            registry,
            buckets=LATENCY_BUCKETS,
        )


# Metrics updated on the hot path of every request. prometheus_client's children take a lock and
# check their arguments on every ``inc``/``observe`` (0.3–0.6 µs each; about a fifth of the model
# gateway's handling of a call, docs/performance.md). These keep plain numbers instead, written only
# by the event loop's thread and read by the scrape (another thread) as they are: each value is
# one attribute, so a scrape sees every value whole, perhaps one request apart from another.


class LoopCount:
    """One labelled counter's value."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0.0

    def inc(self, amount: float = 1.0) -> None:
        self.value += amount


class LoopLevel(LoopCount):
    """One labelled gauge's value."""

    __slots__ = ()

    def dec(self, amount: float = 1.0) -> None:
        self.value -= amount


class LoopTiming:
    """One labelled histogram's buckets (not cumulative: the scrape adds them up) and sum."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last is +Inf
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value


class _LoopFamily(Collector):
    def __init__(
        self, name: str, documentation: str, labelnames: Sequence[str], registry: CollectorRegistry
    ) -> None:
        self.name = name
        self.documentation = documentation
        self.labelnames = tuple(labelnames)
        self._children: dict[tuple[str, ...], object] = {}
        registry.register(self)

    def _child(self, values: tuple[str, ...], make: Callable[[], object]) -> object:
        child = self._children.get(values)
        if child is None:
            if len(values) != len(self.labelnames):
                raise ValueError(f"{self.name} takes the labels {self.labelnames}, got {values}")
            child = self._children[values] = make()
        return child


class _LoopValues(_LoopFamily):
    """A labelled family of single values (``LoopCount`` children), scraped as ``kind``."""

    kind: type[CounterMetricFamily] | type[GaugeMetricFamily]

    def describe(self) -> Iterator[Metric]:
        yield self.kind(self.name, self.documentation, labels=self.labelnames)

    def collect(self) -> Iterator[Metric]:
        family = self.kind(self.name, self.documentation, labels=self.labelnames)
        for values, child in list(self._children.items()):
            assert isinstance(child, LoopCount)
            family.add_metric(values, child.value)
        yield family


class LoopCounter(_LoopValues):
    """A labelled counter for the event loop's hot paths (see ``LoopCount``); look children up once."""

    kind = CounterMetricFamily

    def labels(self, *values: str) -> LoopCount:
        child = self._child(values, LoopCount)
        assert isinstance(child, LoopCount)
        return child


class LoopGauge(_LoopValues):
    """A labelled gauge for the event loop's hot paths (see ``LoopCount``)."""

    kind = GaugeMetricFamily

    def labels(self, *values: str) -> LoopLevel:
        child = self._child(values, LoopLevel)
        assert isinstance(child, LoopLevel)
        return child


class LoopHistogram(_LoopFamily):
    """A labelled histogram for the event loop's hot paths (see ``LoopTiming``)."""

    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: Sequence[str],
        registry: CollectorRegistry,
        *,
        buckets: Sequence[float],
    ) -> None:
        self.bounds = tuple(sorted(b for b in buckets if not math.isinf(b)))
        super().__init__(name, documentation, labelnames, registry)

    def labels(self, *values: str) -> LoopTiming:
        child = self._child(values, lambda: LoopTiming(self.bounds))
        assert isinstance(child, LoopTiming)
        return child

    def describe(self) -> Iterator[Metric]:
        yield HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)

    def collect(self) -> Iterator[Metric]:
        family = HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for values, child in list(self._children.items()):
            assert isinstance(child, LoopTiming)
            counts, total = list(child.counts), child.sum
            cumulative, buckets = 0, []
            for bound, count in zip([*child.bounds, math.inf], counts, strict=True):
                cumulative += count
                buckets.append((_bound_label(bound), float(cumulative)))
            family.add_metric(values, buckets, total)
        yield family


class GaugeFunctions(Collector):
    """A labelled gauge read at scrape time from ``read()``: {label values: value}."""

    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: Sequence[str],
        read: Callable[[], dict[tuple[str, ...], float]],
        registry: CollectorRegistry,
    ) -> None:
        self.name = name
        self.documentation = documentation
        self.labelnames = tuple(labelnames)
        self.read = read
        registry.register(self)

    def describe(self) -> Iterator[Metric]:
        yield GaugeMetricFamily(self.name, self.documentation, labels=self.labelnames)

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for values, value in self.read().items():
            family.add_metric(values, value)
        yield family


def _bound_label(bound: float) -> str:
    return "+Inf" if math.isinf(bound) else repr(float(bound))
