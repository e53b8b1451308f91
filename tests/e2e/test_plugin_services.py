"""Plugin services across three runtime replicas, as real processes with authz holding the leases.

The agent `servant` uses tests/plugins/service_fixtures.py: a singleton service `ticker` (beats
with its fencing token while it runs), a service `local` every replica runs, an event handler of
RUN_ENDED, declared settings with init, and a dependency loaded first. The ticker runs on exactly
one replica at any time; SIGKILL that replica and another takes it over once the lease lapses,
with a higher fencing token; stop that one gracefully and the third takes over at once.
"""

from __future__ import annotations

import itertools
import re
import secrets
import time
import urllib.request
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from parley_platform.bus import Bus
from parley_platform.testing import ServiceProcess, eventually
from support import AGENT_NAMESPACE, ROOT, SessionEnv, Suite, inbound, publish_inbound, replies_to

SERVANT_ID = str(uuid.uuid5(AGENT_NAMESPACE, "agent:servant"))
LEASE_MS = 3000
CHARACTER = """
name: servant
bio: [An agent whose plugin runs services.]
plugins: ["plugins.service_fixtures:service_plugin"]
settings:
  SERVICE_LABEL: alpha
  BEAT_MS: "100"
"""


@dataclass
class Cluster:
    suite: Suite
    bus: Bus
    log: Path

    def lines(self, kind: str) -> list[list[str]]:
        text = self.log.read_text() if self.log.exists() else ""
        return [line.split() for line in text.splitlines() if line.startswith(kind + " ")]

    def running_on(self) -> list[int]:
        """The pids of the live replicas whose ticker state is running (read from their metrics)."""
        found = []
        for runtime in self.suite.runtimes:
            if runtime.process is None or runtime.process.poll() is not None:
                continue
            port = runtime.env["PARLEY_RUNTIME_METRICS_PORT"]
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
                text = response.read().decode()
            pattern = r'^parley_plugin_service_state\{service="ticker",state="running"\} 1\.0$'
            if re.search(pattern, text, re.M):
                found.append(runtime.pid)
        return found

    def starts(self) -> list[tuple[int, int, float]]:
        """(pid, fencing token, time) of every ticker start, in order."""
        return [(int(p), int(t), float(at)) for _, p, t, at, *_ in self.lines("SVC_START")]

    def replica(self, pid: int) -> ServiceProcess:
        return next(r for r in self.suite.runtimes if r.pid == pid)


@pytest.fixture(scope="module")
async def cluster(test_env: SessionEnv, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Cluster]:
    root = tmp_path_factory.mktemp("services")
    characters = root / "characters"
    characters.mkdir()
    (characters / "servant.yaml").write_text(CHARACTER)
    log = root / "fixtures.log"
    suite = Suite(test_env, root / "logs", f"s{secrets.token_hex(4)}")
    try:
        await suite.add_service("parley_authz", "AUTHZ")
        suite.gateway = suite.gateway_process().start()
        await suite.gateway.wait_ready()
        for _ in range(3):
            await suite.add_runtime(
                PARLEY_CHARACTERS_DIR=str(characters),
                PYTHONPATH=str(ROOT / "tests"),
                FIXTURE_LOG=str(log),
                PARLEY_PLUGIN_SERVICE_LEASE_MS=str(LEASE_MS),
            )
        bus = await suite.connect()
        try:
            yield Cluster(suite, bus, log)
        finally:
            await bus.close()
    finally:
        suite.stop()


async def _true(value: bool) -> bool:
    return value


async def test_a_singleton_service_runs_on_one_replica_and_is_handed_over_with_a_higher_token(
    cluster: Cluster,
) -> None:
    pids = {r.pid for r in cluster.suite.runtimes}
    await eventually(lambda: _true(len(cluster.starts()) == 1), what="the ticker to start on one replica")
    [(first, first_token, _)] = cluster.starts()
    assert first in pids

    # Every replica runs the plain service; init ran with the validated settings (BEAT_MS, given
    # as a string, is an integer), the dependency's first, on every replica.
    assert {int(line[1]) for line in cluster.lines("LOCAL_START")} == pids
    inits = cluster.lines("INIT")
    for pid in pids:
        mine = [line[2:] for line in inits if int(line[1]) == pid]
        assert mine == [["base", "-"], ["services", "alpha", "int"]], inits

    # Exactly one replica reports it running, sampled while it beats.
    for _ in range(5):
        await eventually(lambda: _true(cluster.running_on() == [first]), what="one running ticker")

    # The event handler sees the runtime's events of the agent's turns.
    message = inbound("hello servant", agent_id=SERVANT_ID)
    await publish_inbound(cluster.bus, message)
    await eventually(lambda: replies_to(cluster.bus, message), what="the servant's reply")
    await eventually(lambda: _true(bool(cluster.lines("EVENT"))), what="the RUN_ENDED handler")
    assert cluster.lines("EVENT")[0][2] == "RUN_ENDED"

    # SIGKILL the holder: another replica takes over once the lease lapses, with a higher token.
    killed_at = time.time()
    cluster.replica(first).kill()
    await eventually(lambda: _true(len(cluster.starts()) == 2), timeout=30, what="a takeover")
    second, second_token, second_at = cluster.starts()[1]
    assert second != first
    assert second_token > first_token
    took = second_at - killed_at
    lease = LEASE_MS / 1000
    # Within the lease time, plus the standby's retry pause (a tenth of it) and a loaded machine's slack.
    assert took <= lease * 1.1 + 2.0, took
    print(
        f"takeover after SIGKILL: {took:.2f} s (lease {lease:.1f} s), tokens {first_token} -> {second_token}"
    )
    await eventually(lambda: _true(cluster.running_on() == [second]), what="the new holder running")

    # Stop the new holder gracefully: it releases the lease and the third replica takes over at once.
    stopped_at = time.time()
    cluster.replica(second).stop()
    await eventually(lambda: _true(len(cluster.starts()) == 3), timeout=30, what="the second takeover")
    third, third_token, third_at = cluster.starts()[2]
    assert third not in (first, second)
    assert third_token > second_token
    # SIGTERM to takeover: the replica's consumers stop fetching together (one idle long poll,
    # not one each), its turns drain, the ticker stops and the lease is released.
    handed_over = third_at - stopped_at
    print(f"takeover after SIGTERM: {handed_over:.2f} s")
    assert handed_over < lease, "a released lease is taken over without waiting for it to lapse"
    # The stopped replica stopped its services on the way out (the killed one could not).
    assert second in {int(line[1]) for line in cluster.lines("LOCAL_STOP")}
    assert first not in {int(line[1]) for line in cluster.lines("LOCAL_STOP")}
    assert second in {int(line[1]) for line in cluster.lines("SVC_STOP")}

    # Never two at once: each holder's beats end before the next holder starts.
    beats: dict[int, list[float]] = {}
    for _, _pid, token, at in cluster.lines("SVC_BEAT"):
        beats.setdefault(int(token), []).append(float(at))
    spans = sorted((min(times), max(times)) for times in beats.values())
    assert len(spans) == 3, spans
    for (_, previous_end), (next_start, _) in itertools.pairwise(spans):
        assert next_start > previous_end, spans
    assert sorted(beats) == [first_token, second_token, third_token]
