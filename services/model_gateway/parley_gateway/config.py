from __future__ import annotations

from pathlib import Path

from pydantic import Field

from parley_platform.settings import Settings


class GatewaySettings(Settings):
    gateway_grpc_port: int = Field(default=50052, ge=0, le=65535)
    gateway_metrics_port: int = Field(default=9102, ge=0, le=65535)
    # Which provider serves each model type; only `scripted` exists so far.
    model_provider: str = Field(default="scripted", pattern=r"^(scripted)$")
    # YAML or JSON file of scripted rules; empty means the built-in echo rule.
    scripted_rules: Path | None = None
    scripted_latency_ms: float = Field(default=0.0, ge=0, le=60_000)
