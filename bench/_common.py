"""Shared pieces of the benchmarks: infrastructure, service processes, statistics, the report."""

from __future__ import annotations

import json
import os
import secrets
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from parley_devinfra import infra
from parley_devinfra.infra import free_port
from parley_platform.testing import ServiceProcess, create_database, drop_database

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class BenchEnv:
    nats_url: str  # the operator's: what the benchmark's own clients connect as
    database_url: str
    server_database_url: str
    namespace: str
    logs: Path
    endpoints: infra.Endpoints


@contextmanager
def bench_env(*, nats_auth: bool = True) -> Iterator[BenchEnv]:
    """Real NATS and Postgres (PARLEY_TEST_* URLs, else embedded) and its own database and namespace.
    ``nats_auth=False``: NATS without identities or permissions (the baseline of what they cost)."""
    root = Path(tempfile.mkdtemp(prefix="parley-bench-"))
    with infra.session_infra(root, nats_auth=nats_auth) as endpoints:
        suffix = secrets.token_hex(4)
        name = f"parley_bench_{suffix}"
        url = create_database(endpoints.database_url, name)
        try:
            yield BenchEnv(
                endpoints.nats_url_for("operator"),
                url,
                endpoints.database_url,
                f"b{suffix}",
                root / "logs",
                endpoints,
            )
        finally:
            drop_database(endpoints.database_url, name)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


@dataclass
class Series:
    """Latencies (seconds) of one measured operation, with the wall time they took."""

    name: str
    latencies: list[float]
    wall: float

    @property
    def rate(self) -> float:
        return len(self.latencies) / self.wall if self.wall else float("nan")

    @property
    def p50_ms(self) -> float:
        return statistics.median(self.latencies) * 1000

    @property
    def p99_ms(self) -> float:
        return percentile(self.latencies, 99) * 1000

    def figures(self) -> dict[str, float]:
        return {
            "ops_per_s": round(self.rate, 1),
            "p50_ms": round(self.p50_ms, 3),
            "p99_ms": round(self.p99_ms, 3),
            "n": len(self.latencies),
        }

    @classmethod
    def merged(cls, name: str, parts: list[Series]) -> Series:
        """One series of several measured in turns with others (each part's latencies and wall time)."""
        return cls(name, [x for part in parts for x in part.latencies], sum(part.wall for part in parts))


class Clock:
    def __init__(self) -> None:
        self.started = time.perf_counter()

    def elapsed(self) -> float:
        return time.perf_counter() - self.started


def report(title: str, rows: list[Series], summary: dict[str, object]) -> None:
    print(f"\n{title}")
    print(f"{'measure':<44} {'ops/s':>10} {'p50 ms':>9} {'p99 ms':>9} {'n':>6}")
    for row in rows:
        print(
            f"{row.name:<44} {row.rate:>10.1f} {row.p50_ms:>9.3f} {row.p99_ms:>9.3f} {len(row.latencies):>6}"
        )
    for key, value in summary.items():
        if not isinstance(value, dict):
            print(f"{key}: {value}")
    sys.stdout.flush()
    print(json.dumps(summary, sort_keys=True))


def service_nats(env: BenchEnv) -> dict[str, str]:
    """Where a service process finds NATS and who it is there: each picks its own identity's
    password from this (parley_platform.host.nats_credentials)."""
    auth = env.endpoints.nats_auth
    return {**(auth.services_env() if auth else {}), "PARLEY_NATS_URL": env.endpoints.nats_url}


def suite_env(env: BenchEnv) -> dict[str, str]:
    """Settings every service process of a benchmark shares: its NATS, database and namespace,
    the default character, the scripted model at zero latency, quiet logs."""
    return {
        **service_nats(env),
        "PARLEY_DATABASE_URL": env.database_url,
        "PARLEY_NAMESPACE": env.namespace,
        "PARLEY_OPERATOR_TOKEN": secrets.token_hex(16),
        "PARLEY_CHARACTERS_DIR": str(ROOT / "characters"),
        "PARLEY_LOG_LEVEL": "WARNING",
        "PARLEY_ENVIRONMENT": "test",
        "PARLEY_MODEL_PROVIDER": "scripted",
    }


def service_process(module: str, env: BenchEnv, settings: dict[str, str], name: str) -> ServiceProcess:
    """A service (``parley_runtime``, ``parley_gateway``, ``parley_pairing`` or ``parley_web``) on free
    ports, its log under ``env.logs``."""
    prefix = {
        "parley_runtime": "RUNTIME",
        "parley_gateway": "GATEWAY",
        "parley_pairing": "PAIRING",
        "parley_web": "WEB",
    }[module]
    port = free_port()
    return ServiceProcess(
        module,
        {
            **settings,
            f"PARLEY_{prefix}_GRPC_PORT": str(port),
            f"PARLEY_{prefix}_METRICS_PORT": str(free_port()),
        },
        env.logs / f"{name}.log",
        port,
    )


# -- CPU time per operation of each process (Linux /proc) --------------------------------------


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (Linux /proc; 0 elsewhere or once it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def pids_matching(*needles: str) -> list[int]:
    """Processes whose command line holds every needle (Linux /proc)."""
    found = []
    for entry in Path("/proc").iterdir() if Path("/proc").is_dir() else ():
        if not entry.name.isdigit():
            continue
        try:
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if all(needle in command for needle in needles):
            found.append(int(entry.name))
    return found


Groups = dict[str, Callable[[], list[int]]]


def cpu_snapshot(groups: Groups) -> dict[str, dict[int, float]]:
    return {name: {pid: cpu_seconds(pid) for pid in pids()} for name, pids in groups.items()}


def cpu_ms_per_op(
    before: dict[str, dict[int, float]], after: dict[str, dict[int, float]], n: int
) -> dict[str, float]:
    """CPU milliseconds each group of processes spent per operation between two snapshots."""
    return {
        f"{group}_cpu_ms": round(
            sum(spent - before[group].get(pid, 0.0) for pid, spent in after[group].items()) / n * 1000, 3
        )
        for group in after
    }
