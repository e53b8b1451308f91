"""Shared test types: the session's environment and the suite of service processes."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from parley_platform.infra import free_port
from parley_platform.testing import ServiceProcess

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class SessionEnv:
    nats_url: str
    server_database_url: str  # the server's own database, for creating others
    database_url: str  # this session's database
    namespace: str
    token: str

    def service_env(self, **extra: str) -> dict[str, str]:
        env = {
            "PARLEY_NATS_URL": self.nats_url,
            "PARLEY_DATABASE_URL": self.database_url,
            "PARLEY_NAMESPACE": self.namespace,
            "PARLEY_OPERATOR_TOKEN": self.token,
            "PARLEY_ENVIRONMENT": "test",
            "PARLEY_CHARACTERS_DIR": str(ROOT / "characters"),
        }
        env.update(extra)
        return env


@dataclass
class Suite:
    env: SessionEnv
    logs: Path
    gateway: ServiceProcess | None = None
    runtimes: list[ServiceProcess] = field(default_factory=list)

    def gateway_process(self, **extra: str) -> ServiceProcess:
        port = free_port()
        env = self.env.service_env(
            PARLEY_GATEWAY_GRPC_PORT=str(port), PARLEY_GATEWAY_METRICS_PORT=str(free_port()), **extra
        )
        return ServiceProcess("parley_gateway", env, self.logs / f"gateway-{port}.log", port)

    def runtime_process(self, **extra: str) -> ServiceProcess:
        port = free_port()
        metrics = free_port()
        env = self.env.service_env(
            PARLEY_RUNTIME_GRPC_PORT=str(port), PARLEY_RUNTIME_METRICS_PORT=str(metrics), **extra
        )
        process = ServiceProcess("parley_runtime", env, self.logs / f"runtime-{port}.log", port)
        process.metrics_port = metrics  # type: ignore[attr-defined]
        return process

    @property
    def runtime(self) -> ServiceProcess:
        return self.runtimes[0]
