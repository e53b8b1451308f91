"""A local NATS cluster: several ``nats-server`` processes with JetStream, routed to each other on
127.0.0.1, for the tests that kill a stream's leader and for trying a replicated deployment locally.

Each node is an ``EmbeddedNats`` (its own store, log, client and monitoring ports) started with the
same accounts and authorization file, so every identity and the auth callout behave as on one server.
Routes stay on the loopback interface, where nothing but this machine can reach them; a deployment's
routes authenticate (deploy/nats-cluster.conf).
"""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.request
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from .infra import HOST, EmbeddedNats, InfraError, _pick_free_port, _poll, port_free

__all__ = ["NatsCluster", "NatsNode"]

CLUSTER_NAME = "parley"


class NatsNode(EmbeddedNats):
    """One server of a ``NatsCluster``; ``name`` is its JetStream server name (what a stream's
    ``cluster.leader`` names)."""

    def __init__(self, name: str, root: Path, config_file: Path | None, route_port: int) -> None:
        super().__init__(root / name, log_file=root / "logs" / f"{name}.log", config_file=config_file)
        self.name = name
        self.route_port = route_port

    @property
    def route_url(self) -> str:
        return f"nats://{HOST}:{self.route_port}"

    def kill(self) -> None:
        """SIGKILL: no shutdown, no leadership handed over, the store left as the crash left it."""
        if self.pid is not None and self.running():
            os.kill(self.pid, signal.SIGKILL)
            if not _poll(lambda: not self.running(), 10.0):
                raise InfraError(f"nats-server {self.name} survived SIGKILL")
        self.pid = None
        # The kernel lets go of a killed process's listeners a moment after the process is gone;
        # a restart on the same ports waits for that.
        ports = (self.port, self.monitor_port, self.route_port)
        if not _poll(lambda: all(port_free(port) for port in ports), 10.0):
            raise InfraError(f"the ports of nats-server {self.name} stayed busy after SIGKILL")


class NatsCluster:
    """``size`` nats-server processes forming one JetStream cluster; ``url`` lists every node."""

    def __init__(self, root: Path, *, size: int = 3, config_file: Path | None = None) -> None:
        if size < 1:
            raise InfraError(f"a cluster has at least one node, not {size}")
        self.root = root.resolve()
        taken: set[int] = set()
        self.nodes: list[NatsNode] = []
        for index in range(1, size + 1):
            route = _pick_free_port(taken)
            taken.add(route)
            node = NatsNode(f"n{index}", self.root, config_file, route)
            node.port = _pick_free_port(taken)
            taken.add(node.port)
            node.monitor_port = _pick_free_port(taken)
            taken.add(node.monitor_port)
            self.nodes.append(node)
        routes = ",".join(node.route_url for node in self.nodes)
        for node in self.nodes:
            node.extra_args = [
                "--name",
                node.name,
                "--cluster_name",
                CLUSTER_NAME,
                "--cluster",
                node.route_url,
                "--routes",
                routes,
            ]

    @property
    def url(self) -> str:
        """Every node's client URL, comma-separated (what ``PARLEY_NATS_URL`` takes)."""
        return ",".join(node.url for node in self.nodes)

    def node(self, name: str) -> NatsNode:
        for node in self.nodes:
            if node.name == name:
                return node
        raise InfraError(f"no node {name!r} in the cluster (nodes: {', '.join(n.name for n in self.nodes)})")

    def start(self, timeout: float = 30.0) -> str:
        """Start every node, then wait until each is healthy and they agree on a meta leader."""
        with ExitStack() as rollback:
            for node in self.nodes:
                rollback.callback(node.stop)
                node.launch()
            for node in self.nodes:
                node.wait_ready(timeout)
            self.wait_formed(timeout)
            rollback.pop_all()
        return self.url

    def restart(self, node: NatsNode, timeout: float = 30.0) -> None:
        """Start a stopped (or killed) node again on its ports and store, and wait for it to rejoin."""
        node.launch()
        node.wait_ready(timeout)
        self.wait_formed(timeout)

    def wait_formed(self, timeout: float = 30.0) -> str:
        """Wait until every running node sees the same JetStream meta leader and all its peers;
        returns the leader's name."""
        deadline = time.monotonic() + timeout
        while True:
            leaders = {_meta(node).get("leader") for node in self.nodes if node.running()}
            sizes = {_meta(node).get("cluster_size") for node in self.nodes if node.running()}
            if len(leaders) == 1 and None not in leaders and "" not in leaders and sizes == {len(self.nodes)}:
                return str(leaders.pop())
            if time.monotonic() >= deadline:
                raise InfraError(
                    f"the NATS cluster did not agree on a meta leader within {timeout:.0f} s "
                    f"(leaders seen: {sorted(str(x) for x in leaders)}); logs in {self.root / 'logs'}"
                )
            time.sleep(0.1)

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()


def _meta(node: EmbeddedNats) -> dict[str, Any]:
    """The node's view of the JetStream meta group (``/jsz``), or {} when it does not answer."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(f"{node.monitor_url}/jsz", timeout=2.0) as response:
            body = json.loads(response.read() or b"{}")
    except (OSError, ValueError):
        return {}
    meta = body.get("meta_cluster") if isinstance(body, dict) else None
    return meta if isinstance(meta, dict) else {}
