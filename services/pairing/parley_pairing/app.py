"""The pairing service: its API, and a sweeper that deletes expired requests and claims."""

from __future__ import annotations

from parley.v1 import pairing_pb2
from parley_platform import permissions
from parley_platform.bus import Bus, tls_context
from parley_platform.host import ServiceHost, ServiceSpec
from parley_platform.logging import get_logger
from parley_platform.service import Combined

from .api import PairingApi, PairingMetrics
from .callout import Callout, CalloutMetrics, Kicker
from .config import PairingSettings
from .connectors_api import ConnectorsApi
from .store import MIGRATIONS_DIR, SCHEMA, ConnectorStore, PairingStore

log = get_logger(__name__)

SPEC = ServiceSpec(
    "pairing",
    identity="pairing",
    grpc_port="pairing_grpc_port",
    metrics_port="pairing_metrics_port",
    schema=SCHEMA,
    migrations=MIGRATIONS_DIR,
)


async def connect_system(host: ServiceHost[PairingSettings]) -> Bus | None:
    """NATS' system user, through which a revocation closes a connector's connections."""
    s = host.settings
    if s.pairing_system_password is None:
        return None
    system = await Bus.connect(
        s.nats_url,
        name="pairing-system",
        namespace=s.namespace,
        user=permissions.SYSTEM_USER,
        password=s.pairing_system_password.get_secret_value(),
        tls=tls_context(s.nats_tls_ca, s.nats_tls_cert, s.nats_tls_key),
    )
    host.on_stop("system connection", system.close)
    return system


async def setup(host: ServiceHost[PairingSettings]) -> None:
    s = host.settings
    store = PairingStore(
        host.db, ttl_seconds=s.pairing_request_ttl_seconds, max_pending=s.pairing_max_pending
    )
    metrics = PairingMetrics(host.registry)
    connectors = ConnectorStore(host.db)
    system = await connect_system(host)
    api = Combined(PairingApi(store, metrics), ConnectorsApi(connectors, Kicker(system), s.namespace))
    host.serve(api, pairing_pb2, "Pairing")
    if s.pairing_callout_seed is not None:
        callout = Callout(
            host.bus, connectors, s.pairing_callout_seed.get_secret_value(), CalloutMetrics(host.registry)
        )
        host.component("connector admission", callout)
    else:
        log.warning("no PARLEY_PAIRING_CALLOUT_SEED: connectors cannot connect to NATS")

    async def sweep() -> None:
        """Delete expired requests and claims, then refresh the pending gauge from the database."""
        requests, claims = await store.purge(s.pairing_sweep_batch)
        if requests or claims:
            log.info("expired pairing state deleted", requests=requests, claims=claims)
        metrics.set_pending(await store.pending_counts())

    host.every("sweeper", s.pairing_sweep_interval_seconds, sweep)
    host.ready_fields.update(ttl_seconds=s.pairing_request_ttl_seconds, max_pending=s.pairing_max_pending)
