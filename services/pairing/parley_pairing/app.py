"""Wiring of the pairing service: start in order, stop in reverse."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from functools import partial

from prometheus_client import CollectorRegistry

from parley.v1 import pairing_pb2, pairing_pb2_grpc
from parley_platform.bus import Bus
from parley_platform.errors import InvalidArgument, ParleyError
from parley_platform.grpcserver import GrpcServer, start_grpc_server
from parley_platform.lifecycle import shutdown_in_order
from parley_platform.logging import get_logger
from parley_platform.metrics import MessagingMetrics, MetricsServer, serve
from parley_platform.postgres import Database, migrate
from parley_platform.rpc import RpcServer
from parley_platform.service import grpc_binding, register_nats

from .api import PairingApi, PairingMetrics
from .config import PairingSettings
from .store import MIGRATIONS_DIR, SCHEMA, PairingStore

log = get_logger(__name__)

SERVICE = "pairing"


class PairingApp:
    def __init__(self, settings: PairingSettings) -> None:
        self.settings = settings
        self.registry = CollectorRegistry()
        self.metrics = PairingMetrics(self.registry)
        self.db: Database | None = None
        self.bus: Bus | None = None
        self.rpc_server: RpcServer | None = None
        self.grpc: GrpcServer | None = None
        self.metrics_server: MetricsServer | None = None
        self.sweeper: asyncio.Task[None] | None = None
        self.stopping = asyncio.Event()

    async def start(self) -> None:
        s = self.settings
        if s.operator_token is None:
            raise InvalidArgument(
                "PARLEY_OPERATOR_TOKEN is not set",
                code="OPERATOR_TOKEN_REQUIRED",
                hint="`parley run` sets one for you; otherwise choose a long random string",
            )
        await migrate(s.database_url, SCHEMA, MIGRATIONS_DIR)
        self.db = Database(s.database_url, name=SERVICE, min_size=s.db_pool_min, max_size=s.db_pool_max)
        await self.db.open()
        self.store = PairingStore(
            self.db, ttl_seconds=s.pairing_request_ttl_seconds, max_pending=s.pairing_max_pending
        )
        self.api = PairingApi(self.store, self.metrics)
        self.bus = await Bus.connect(s.nats_url, name=SERVICE, namespace=s.namespace)
        self.rpc_server = RpcServer(self.bus, SERVICE, metrics=MessagingMetrics(self.registry))
        register_nats(self.rpc_server, self.api, pairing_pb2, "Pairing")
        await self.rpc_server.start()
        self.grpc = await start_grpc_server(
            [grpc_binding(self.api, pairing_pb2, pairing_pb2_grpc, "Pairing")],
            host=s.grpc_host,
            port=s.pairing_grpc_port,
            token=s.operator_token.get_secret_value(),
        )
        self.metrics_server = serve(
            self.registry, s.metrics_host, s.pairing_metrics_port, port_setting="PARLEY_PAIRING_METRICS_PORT"
        )
        self.sweeper = asyncio.create_task(self._sweep_forever(), name="pairing-sweeper")
        log.info(
            "pairing ready",
            grpc_port=self.grpc.port,
            metrics_port=self.metrics_server.port,
            namespace=s.namespace,
            ttl_seconds=s.pairing_request_ttl_seconds,
            max_pending=s.pairing_max_pending,
        )

    async def sweep(self) -> None:
        """Delete expired requests and claims, then refresh the pending gauge from the database."""
        requests, claims = await self.store.purge(self.settings.pairing_sweep_batch)
        if requests or claims:
            log.info("expired pairing state deleted", requests=requests, claims=claims)
        self.metrics.set_pending(await self.store.pending_counts())

    async def _sweep_forever(self) -> None:
        while not self.stopping.is_set():
            try:
                await self.sweep()
            except ParleyError as exc:
                # A database blip costs one sweep; the next one catches up.
                log.warning("pairing sweep failed", code=exc.code, error=exc.message)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stopping.wait(), self.settings.pairing_sweep_interval_seconds)

    async def _stop_sweeper(self) -> None:
        self.stopping.set()
        if self.sweeper is not None:
            await asyncio.wait({self.sweeper})

    async def stop(self) -> None:
        steps: list[tuple[str, Callable[[], Awaitable[object]]]] = [("sweeper", self._stop_sweeper)]
        if self.rpc_server:
            steps.append(("rpc", partial(self.rpc_server.stop, 5)))
        if self.grpc:
            steps.append(("grpc", partial(self.grpc.stop, 2)))
        if self.bus:
            steps.append(("nats", self.bus.close))
        if self.db:
            steps.append(("database", self.db.close))
        await shutdown_in_order(steps, timeout=self.settings.shutdown_timeout_seconds)
        if self.metrics_server:
            self.metrics_server.stop()
