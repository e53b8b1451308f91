from __future__ import annotations

from typing import Literal

from pydantic import Field

from parley_platform.settings import Settings


class AuthzSettings(Settings):
    authz_grpc_port: int = Field(default=50054, ge=0, le=65535)
    authz_metrics_port: int = Field(default=9104, ge=0, le=65535)
    # What an approval nobody decided in time becomes: deny settles it as
    # `expired`; approve claims it as if approved (PutPending can override per call).
    authz_expiry_decision: Literal["deny", "approve"] = "deny"
    # How often each replica expires due approvals and republishes unannounced events.
    authz_sweep_interval_seconds: float = Field(default=1.0, gt=0, le=3600)
    # How long after a decision its event counts as lost and is published again.
    authz_announce_grace_seconds: float = Field(default=5.0, ge=0, le=3600)
    # How long an expired capability decision nobody authorized is kept (an Authorize of it until
    # then is told it expired; after, that it was consumed or burned), and how often each replica
    # deletes the ones kept longer.
    authz_decision_retention_seconds: float = Field(default=3600.0, ge=0, le=30 * 86400)
    authz_decision_sweep_seconds: float = Field(default=60.0, gt=0, le=86400)
    # How often the pending and lease gauges are read from the database.
    authz_gauge_interval_seconds: float = Field(default=5.0, gt=0, le=3600)
