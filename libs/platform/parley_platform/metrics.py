"""Prometheus metrics: one registry per service, served on its own port."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

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
        self.received = Counter(
            "parley_received_messages_total", "Messages received by consumers", ["stream"], registry=registry
        )
        self.processed = Histogram(
            "parley_processed_duration_seconds",
            "Time to handle one message",
            ["stream", "outcome"],
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.dead = Counter(
            "parley_dead_letters_total",
            "Messages sent to the dead-letter stream",
            ["stream", "reason"],
            registry=registry,
        )
        self.inflight = Gauge(
            "parley_messages_inflight", "Messages being handled now", ["stream"], registry=registry
        )
        self.rpc = Histogram(
            "parley_rpc_duration_seconds",
            "NATS RPC handling time",
            ["method", "outcome"],
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
