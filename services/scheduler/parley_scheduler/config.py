from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from pydantic import Field

from parley_platform.settings import Settings


class Mode(StrEnum):
    SERVICE = "service"  # replicas claim and dispatch continuously
    SERVERLESS = "serverless"  # nothing runs until RunDueTasks is called


class SchedulerSettings(Settings):
    scheduler_grpc_port: int = Field(default=50053, ge=0, le=65535)
    scheduler_metrics_port: int = Field(default=9103, ge=0, le=65535)
    scheduler_mode: Mode = Mode.SERVICE
    # Tasks claimed by one statement, and in flight per replica.
    scheduler_batch_size: int = Field(default=64, ge=1, le=1000)
    scheduler_max_inflight: int = Field(default=256, ge=1, le=10_000)
    # The fallback when no notification arrives; an idle queue sleeps this long between looks.
    scheduler_poll_interval_seconds: float = Field(default=5.0, gt=0, le=3600)
    # A run's lease; the worker heartbeats every third of it. An expired lease is claimed again.
    scheduler_lease_seconds: float = Field(default=30.0, ge=0.3, le=3600)
    # The deadline of one run, unless the task sets metadata.timeout_ms.
    scheduler_task_timeout_seconds: float = Field(default=300.0, gt=0, le=86_400)
    # After start-up, "no worker" only skips a run for this long before tasks are paused or failed.
    scheduler_no_worker_grace_seconds: float = Field(default=60.0, ge=0)
    scheduler_no_worker_retry_seconds: float = Field(default=1.0, gt=0)
    # How often orphaned workers are probed and the due gauge refreshed.
    scheduler_maintenance_seconds: float = Field(default=5.0, gt=0)
    # How long uncertain attempts (runs lost with their lease) stay visible before maintenance prunes them.
    scheduler_uncertain_retention_days: float = Field(default=30.0, gt=0)
    # Name of this replica in leases; default host-pid-random.
    scheduler_replica: str = ""


@dataclass(frozen=True)
class EngineConfig:
    """What one replica's engine runs with, in the units it computes in."""

    owner: str
    lease_ms: int
    timeout_ms: int
    batch_size: int
    max_inflight: int
    poll_interval: float
    no_worker_grace: float
    no_worker_retry_ms: int
    maintenance_interval: float
    uncertain_retention_ms: int = 30 * 86_400_000
