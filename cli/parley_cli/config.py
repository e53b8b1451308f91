"""Where the CLI finds the suite: environment first, then what `parley infra up` recorded."""

from __future__ import annotations

import os
import secrets
from pathlib import Path

from parley_platform import infra

DEFAULT_PORTS = {
    "runtime": (50051, 9101),
    "model-gateway": (50052, 9102),
    "scheduler": (50053, 9103),
    "authz": (50054, 9104),
    "pairing": (50055, 9105),
}


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
    if os.environ.get("PARLEY_NATS_URL"):
        return os.environ["PARLEY_NATS_URL"]
    endpoints = infra.read_endpoints(state_dir())
    return endpoints.nats_url if endpoints else None


def namespace() -> str:
    return os.environ.get("PARLEY_NAMESPACE", "parley")


def grpc_address(service: str) -> str:
    env = {"runtime": "PARLEY_RUNTIME_GRPC_PORT", "model-gateway": "PARLEY_GATEWAY_GRPC_PORT"}.get(service)
    port = int(os.environ.get(env, DEFAULT_PORTS[service][0])) if env else DEFAULT_PORTS[service][0]
    host = os.environ.get("PARLEY_GRPC_HOST", "127.0.0.1")
    return os.environ.get(f"PARLEY_{service.upper().replace('-', '_')}_ADDR", f"{host}:{port}")
