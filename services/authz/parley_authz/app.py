"""Wiring of the authz service: start in order, stop in reverse."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from functools import partial

from prometheus_client import CollectorRegistry

from parley.v1 import authz_pb2, authz_pb2_grpc
from parley_platform.bus import Bus
from parley_platform.errors import InvalidArgument, ParleyError
from parley_platform.grpcserver import GrpcServer, start_grpc_server
from parley_platform.lifecycle import shutdown_in_order
from parley_platform.logging import get_logger
from parley_platform.metrics import MessagingMetrics, MetricsServer, serve
from parley_platform.postgres import Database, migrate
from parley_platform.rpc import RpcServer
from parley_platform.service import grpc_binding, register_nats

from .api import AuthzApi
from .config import AuthzSettings
from .metrics import PENDING_KINDS, AuthzMetrics
from .store import MIGRATIONS_DIR, SCHEMA, AuthzStore

log = get_logger(__name__)

SERVICE = "authz"
EXPIRE_BATCH = 100


def _sweeper_done(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and (exc := task.exception()) is not None:
        log.error("sweeper stopped: approvals no longer expire", error=repr(exc))


class AuthzApp:
    def __init__(self, settings: AuthzSettings) -> None:
        self.settings = settings
        self.registry = CollectorRegistry()
        self.metrics = AuthzMetrics(self.registry)
        self.grpc: GrpcServer | None = None
        self.metrics_server: MetricsServer | None = None
        self.rpc_server: RpcServer | None = None
        self.bus: Bus | None = None
        self.db: Database | None = None
        self.api: AuthzApi | None = None
        self.sweeper: asyncio.Task[None] | None = None

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
        self.bus = await Bus.connect(s.nats_url, name=SERVICE, namespace=s.namespace)
        await self.bus.ensure_standard_streams()
        self.api = AuthzApi(
            store=AuthzStore(self.db),
            bus=self.bus,
            metrics=self.metrics,
            expiry_decision=s.authz_expiry_decision,
        )
        self.rpc_server = RpcServer(self.bus, SERVICE, metrics=MessagingMetrics(self.registry))
        register_nats(self.rpc_server, self.api, authz_pb2, "Authz")
        await self.rpc_server.start()
        self.grpc = await start_grpc_server(
            [grpc_binding(self.api, authz_pb2, authz_pb2_grpc, "Authz")],
            host=s.grpc_host,
            port=s.authz_grpc_port,
            token=s.operator_token.get_secret_value(),
        )
        self.metrics_server = serve(
            self.registry, s.metrics_host, s.authz_metrics_port, port_setting="PARLEY_AUTHZ_METRICS_PORT"
        )
        self.sweeper = asyncio.create_task(self.sweep_forever(self.api))
        self.sweeper.add_done_callback(_sweeper_done)
        log.info(
            "authz ready",
            grpc_port=self.grpc.port,
            metrics_port=self.metrics_server.port,
            namespace=s.namespace,
        )

    async def sweep_once(self, api: AuthzApi) -> None:
        while await api.expire_due(EXPIRE_BATCH) == EXPIRE_BATCH:
            pass
        await api.republish(self.settings.authz_announce_grace_seconds)

    async def refresh_gauges(self, api: AuthzApi) -> None:
        rows = {row["kind"]: row for row in await api.store.gauges()}
        for kind in PENDING_KINDS:
            self.metrics.pending.labels(kind).set(rows[kind]["n"])
            self.metrics.pending_age.labels(kind).set(rows[kind]["oldest_seconds"])
        self.metrics.leases_active.set(rows["lease"]["n"])

    async def sweep_forever(self, api: AuthzApi) -> None:
        """Every replica expires due approvals, republishes lost events and reads the gauges.

        Each step is a conditional statement, so replicas sweeping at once never
        decide anything twice. A failing step (database or NATS away) is logged
        and tried again at the next tick."""
        s = self.settings
        next_gauges = 0.0
        while True:
            try:
                await self.sweep_once(api)
                if time.monotonic() >= next_gauges:
                    await self.refresh_gauges(api)
                    next_gauges = time.monotonic() + s.authz_gauge_interval_seconds
            except ParleyError as exc:
                log.warning("sweep failed; retrying", code=exc.code, error=exc.message)
            await asyncio.sleep(s.authz_sweep_interval_seconds)

    async def stop(self) -> None:
        timeout = self.settings.shutdown_timeout_seconds
        if self.sweeper:
            self.sweeper.cancel()
            await asyncio.gather(self.sweeper, return_exceptions=True)
        steps: list[tuple[str, Callable[[], Awaitable[object]]]] = []
        if self.grpc:
            steps.append(("grpc", partial(self.grpc.stop, 2)))
        if self.rpc_server:
            steps.append(("rpc", partial(self.rpc_server.stop, 5)))
        if self.api:
            steps.append(("events", self.api.aclose))
        if self.bus:
            steps.append(("nats", self.bus.close))
        if self.db:
            steps.append(("database", self.db.close))
        await shutdown_in_order(steps, timeout=timeout + 5)
        if self.metrics_server:
            self.metrics_server.stop()
