"""Where the CLI finds the suite: environment first, then what `parley infra up` recorded."""

from __future__ import annotations

import os
import secrets
from dataclasses import dataclass
from pathlib import Path

from parley_devinfra import infra


@dataclass(frozen=True)
class Service:
    """A service of the suite: its module and ports (``PARLEY_<KEY>_GRPC_PORT``, ``_METRICS_PORT``)."""

    name: str
    module: str
    key: str
    grpc_port: int
    metrics_port: int

    @property
    def grpc_env(self) -> str:
        return f"PARLEY_{self.key}_GRPC_PORT"

    @property
    def metrics_env(self) -> str:
        return f"PARLEY_{self.key}_METRICS_PORT"


# In start order: `parley run` starts them top to bottom and stops them bottom to top.
# The runtime comes after the services it calls; the web connector last, as it calls the runtime.
SERVICES = [
    Service("model-gateway", "parley_gateway", "GATEWAY", 50052, 9102),
    Service("pairing", "parley_pairing", "PAIRING", 50055, 9105),
    Service("authz", "parley_authz", "AUTHZ", 50054, 9104),
    Service("scheduler", "parley_scheduler", "SCHEDULER", 50053, 9103),
    Service("runtime", "parley_runtime", "RUNTIME", 50051, 9101),
    Service("web", "parley_web", "WEB", 50056, 9106),
]
WEB_PORT_ENV = "PARLEY_WEB_PORT"
WEB_PORT = 8080
SERVICE_BY_NAME = {service.name: service for service in SERVICES}


def state_dir() -> Path:
    return Path(os.environ.get("PARLEY_STATE_DIR", ".parley"))


def operator_token(create: bool = False) -> str | None:
    """PARLEY_OPERATOR_TOKEN, else the token `parley run` keeps in .parley/operator-token."""
    token = os.environ.get("PARLEY_OPERATOR_TOKEN")
    if token:
        return token
    path = state_dir() / "operator-token"
    if path.exists():
        return path.read_text().strip()
    if not create:
        return None
    path.parent.mkdir(parents=True, exist_ok=True)
    token = secrets.token_urlsafe(32)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(token + "\n")
    return token


def nats_url() -> str | None:
    """Where the CLI connects as the operator: PARLEY_NATS_URL (with PARLEY_NATS_USER /
    PARLEY_NATS_PASSWORD, or the operator's credentials in the URL), else what `parley infra up`
    recorded, with the operator's credentials it generated."""
    if os.environ.get("PARLEY_NATS_URL"):
        return os.environ["PARLEY_NATS_URL"]
    endpoints = infra.read_endpoints(state_dir())
    return endpoints.nats_url_for("operator") if endpoints else None


def nats_credentials() -> tuple[str | None, str | None]:
    """The operator's NATS user and password when they are not in the URL: PARLEY_NATS_USER /
    PARLEY_NATS_PASSWORD, else ``operator`` with PARLEY_OPERATOR_NATS_PASSWORD (as in the `.env`
    that `make secrets` writes for docker-compose)."""
    password = os.environ.get("PARLEY_NATS_PASSWORD") or os.environ.get("PARLEY_OPERATOR_NATS_PASSWORD")
    if not password:
        return os.environ.get("PARLEY_NATS_USER") or None, None
    return os.environ.get("PARLEY_NATS_USER") or "operator", password


def grpc_tls_ca() -> Path | None:
    """PARLEY_GRPC_TLS_CA: the CA that signed the services' gRPC certificates; set, the CLI speaks
    TLS to them (and `parley run` checks their health over TLS)."""
    value = os.environ.get("PARLEY_GRPC_TLS_CA")
    return Path(value) if value else None


def namespace() -> str:
    return os.environ.get("PARLEY_NAMESPACE", "parley")


def address_env(service: str) -> str:
    return f"PARLEY_{service.upper().replace('-', '_')}_ADDR"


def grpc_address(service: str) -> str:
    """``PARLEY_<NAME>_ADDR`` (e.g. PARLEY_RUNTIME_ADDR), else the local host and the service's gRPC port."""
    spec = SERVICE_BY_NAME[service]
    explicit = os.environ.get(address_env(service))
    if explicit:
        return explicit
    host = os.environ.get("PARLEY_GRPC_HOST", "127.0.0.1")
    if host in ("0.0.0.0", "::"):
        host = "127.0.0.1"
    return f"{host}:{os.environ.get(spec.grpc_env, spec.grpc_port)}"
