"""The authz service: its API, a sweeper that expires due approvals and republishes lost events,
and one that deletes expired capability decisions nobody authorized."""

from __future__ import annotations

from parley.v1 import authz_pb2
from parley_platform.host import ServiceHost, ServiceSpec
from parley_platform.logging import get_logger

from .api import AuthzApi
from .config import AuthzSettings
from .metrics import PENDING_KINDS, AuthzMetrics
from .store import MIGRATIONS_DIR, SCHEMA, AuthzStore

EXPIRE_BATCH = 100
SWEEP_BATCH = 1000

log = get_logger(__name__)

SPEC = ServiceSpec(
    "authz",
    identity="authz",
    grpc_port="authz_grpc_port",
    metrics_port="authz_metrics_port",
    schema=SCHEMA,
    migrations=MIGRATIONS_DIR,
    standard_streams=True,
)


async def setup(host: ServiceHost[AuthzSettings]) -> None:
    s = host.settings
    metrics = AuthzMetrics(host.registry)
    api = AuthzApi(
        store=AuthzStore(host.db), bus=host.bus, metrics=metrics, expiry_decision=s.authz_expiry_decision
    )
    host.serve(api, authz_pb2, "Authz")
    host.on_stop("events", api.aclose)

    async def sweep() -> None:
        """Every replica expires due approvals and republishes lost events. Each step is a
        conditional statement, so replicas sweeping at once never decide anything twice."""
        while await api.expire_due(EXPIRE_BATCH) == EXPIRE_BATCH:
            pass
        await api.republish(s.authz_announce_grace_seconds)

    async def sweep_decisions() -> None:
        """Expired decisions nobody authorized are deleted after their retention, a batch at a time
        (replicas sweeping at once skip each other's rows)."""
        while True:
            swept = await api.store.sweep_expired_decisions(s.authz_decision_retention_seconds, SWEEP_BATCH)
            if swept:
                metrics.burned.labels("unused").inc(swept)
                log.info("expired capability decisions swept", swept=swept)
            if swept < SWEEP_BATCH:
                return

    async def refresh_gauges() -> None:
        gauges = {gauge.kind: gauge for gauge in await api.store.gauges()}
        for kind in PENDING_KINDS:
            metrics.pending.labels(kind).set(gauges[kind].n)
            metrics.pending_age.labels(kind).set(gauges[kind].oldest_seconds)
        metrics.leases_active.set(gauges["lease"].n)

    host.every("sweeper", s.authz_sweep_interval_seconds, sweep)
    host.every("gauges", s.authz_gauge_interval_seconds, refresh_gauges)
    host.every("decision sweeper", s.authz_decision_sweep_seconds, sweep_decisions)
