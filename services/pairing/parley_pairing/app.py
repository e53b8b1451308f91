"""The pairing service: its API, and a sweeper that deletes expired requests and claims."""

from __future__ import annotations

from parley.v1 import pairing_pb2
from parley_platform.host import ServiceHost, ServiceSpec
from parley_platform.logging import get_logger

from .api import PairingApi, PairingMetrics
from .config import PairingSettings
from .store import MIGRATIONS_DIR, SCHEMA, PairingStore

log = get_logger(__name__)

SPEC = ServiceSpec(
    "pairing",
    grpc_port="pairing_grpc_port",
    metrics_port="pairing_metrics_port",
    schema=SCHEMA,
    migrations=MIGRATIONS_DIR,
)


async def setup(host: ServiceHost[PairingSettings]) -> None:
    s = host.settings
    store = PairingStore(
        host.db, ttl_seconds=s.pairing_request_ttl_seconds, max_pending=s.pairing_max_pending
    )
    metrics = PairingMetrics(host.registry)
    host.serve(PairingApi(store, metrics), pairing_pb2, "Pairing")

    async def sweep() -> None:
        """Delete expired requests and claims, then refresh the pending gauge from the database."""
        requests, claims = await store.purge(s.pairing_sweep_batch)
        if requests or claims:
            log.info("expired pairing state deleted", requests=requests, claims=claims)
        metrics.set_pending(await store.pending_counts())

    host.every("sweeper", s.pairing_sweep_interval_seconds, sweep)
    host.ready_fields.update(ttl_seconds=s.pairing_request_ttl_seconds, max_pending=s.pairing_max_pending)
