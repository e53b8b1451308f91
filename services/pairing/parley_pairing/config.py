from __future__ import annotations

from pydantic import Field, SecretStr

from parley_platform.settings import Settings


class PairingSettings(Settings):
    pairing_grpc_port: int = Field(default=50055, ge=0, le=65535)
    pairing_metrics_port: int = Field(default=9105, ge=0, le=65535)
    # How long a pending request (and its code) lives, and the window in which
    # a sender is told its code once.
    pairing_request_ttl_seconds: float = Field(default=3600.0, gt=0, le=30 * 24 * 3600)
    # Live requests per agent and channel; a new sender beyond this gets no code.
    pairing_max_pending: int = Field(default=3, ge=1, le=100)
    # How often each replica deletes expired requests and claims and refreshes
    # the parley_pairing_pending gauge.
    pairing_sweep_interval_seconds: float = Field(default=15.0, gt=0, le=3600)
    pairing_sweep_batch: int = Field(default=1000, ge=1, le=100_000)
    # Connectors' admission to NATS (auth callout): the seed of the issuer key the NATS server
    # trusts (auth_callout.issuer), and the password of NATS' system user, through which revoked
    # connectors' connections are closed. Without the seed, no connector can connect.
    pairing_callout_seed: SecretStr | None = None
    pairing_system_password: SecretStr | None = None
