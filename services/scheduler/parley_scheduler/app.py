"""The scheduler service: its API and the engine that claims due tasks and dispatches them."""

from __future__ import annotations

from parley.v1 import scheduler_pb2
from parley_platform.host import ServiceHost, ServiceSpec

from .api import SchedulerApi
from .config import EngineConfig, Mode, SchedulerSettings
from .engine import Engine, default_replica_name
from .metrics import SchedulerMetrics
from .store import MIGRATIONS_DIR, SCHEMA, SchedulerStore

SPEC = ServiceSpec(
    "scheduler",
    identity="scheduler",
    grpc_port="scheduler_grpc_port",
    metrics_port="scheduler_metrics_port",
    schema=SCHEMA,
    migrations=MIGRATIONS_DIR,
)


async def setup(host: ServiceHost[SchedulerSettings]) -> None:
    s = host.settings
    store = SchedulerStore(host.db)
    metrics = SchedulerMetrics(host.registry)
    claim_loop = s.scheduler_mode is Mode.SERVICE
    engine = Engine(
        store=store,
        bus=host.bus,
        config=EngineConfig(
            owner=s.scheduler_replica or default_replica_name(),
            lease_ms=round(s.scheduler_lease_seconds * 1000),
            timeout_ms=round(s.scheduler_task_timeout_seconds * 1000),
            batch_size=s.scheduler_batch_size,
            max_inflight=s.scheduler_max_inflight,
            poll_interval=s.scheduler_poll_interval_seconds,
            no_worker_grace=s.scheduler_no_worker_grace_seconds,
            no_worker_retry_ms=round(s.scheduler_no_worker_retry_seconds * 1000),
            maintenance_interval=s.scheduler_maintenance_seconds,
            uncertain_retention_ms=round(s.scheduler_uncertain_retention_days * 86_400_000),
        ),
        metrics=metrics,
        database_url=s.database_url,
        claim_loop=claim_loop,
    )
    api = SchedulerApi(store=store, engine=engine, metrics=metrics, claim_loop=claim_loop)
    host.serve(api, scheduler_pb2, "Scheduler")
    host.component("engine", engine)
    host.on_stop("api", api.close)
    host.ready_fields.update(mode=s.scheduler_mode.value, replica=engine.config.owner)
