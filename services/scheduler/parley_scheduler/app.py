"""Wiring of the scheduler service: start in order, stop in reverse."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from functools import partial

from prometheus_client import CollectorRegistry

from parley.v1 import scheduler_pb2, scheduler_pb2_grpc
from parley_platform.bus import Bus
from parley_platform.errors import InvalidArgument
from parley_platform.grpcserver import GrpcServer, start_grpc_server
from parley_platform.lifecycle import shutdown_in_order
from parley_platform.logging import get_logger
from parley_platform.metrics import MessagingMetrics, MetricsServer, serve
from parley_platform.postgres import Database, migrate
from parley_platform.rpc import RpcServer
from parley_platform.service import grpc_binding, register_nats

from .api import SchedulerApi
from .config import Mode, SchedulerSettings
from .engine import Engine, EngineConfig, SchedulerMetrics, default_replica_name
from .store import MIGRATIONS_DIR, SCHEMA, SchedulerStore

log = get_logger(__name__)

SERVICE = "scheduler"


class SchedulerApp:
    def __init__(self, settings: SchedulerSettings) -> None:
        self.settings = settings
        self.registry = CollectorRegistry()
        self.grpc: GrpcServer | None = None
        self.metrics_server: MetricsServer | None = None
        self.rpc_server: RpcServer | None = None
        self.engine: Engine | None = None
        self.api: SchedulerApi | None = None
        self.bus: Bus | None = None
        self.db: Database | None = None

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
        store = SchedulerStore(self.db)
        self.bus = await Bus.connect(s.nats_url, name=SERVICE, namespace=s.namespace)
        metrics = SchedulerMetrics(self.registry)
        claim_loop = s.scheduler_mode is Mode.SERVICE
        self.engine = Engine(
            store=store,
            bus=self.bus,
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
        )
        self.api = SchedulerApi(store=store, engine=self.engine, metrics=metrics, claim_loop=claim_loop)
        self.rpc_server = RpcServer(self.bus, SERVICE, metrics=MessagingMetrics(self.registry))
        register_nats(self.rpc_server, self.api, scheduler_pb2, "Scheduler")
        await self.rpc_server.start()
        self.grpc = await start_grpc_server(
            [grpc_binding(self.api, scheduler_pb2, scheduler_pb2_grpc, "Scheduler")],
            host=s.grpc_host,
            port=s.scheduler_grpc_port,
            token=s.operator_token.get_secret_value(),
        )
        self.metrics_server = serve(
            self.registry,
            s.metrics_host,
            s.scheduler_metrics_port,
            port_setting="PARLEY_SCHEDULER_METRICS_PORT",
        )
        await self.engine.start(claim_loop=claim_loop)
        log.info(
            "scheduler ready",
            grpc_port=self.grpc.port,
            metrics_port=self.metrics_server.port,
            namespace=s.namespace,
            mode=s.scheduler_mode.value,
            replica=self.engine.config.owner,
        )

    async def stop(self) -> None:
        timeout = self.settings.shutdown_timeout_seconds
        steps: list[tuple[str, Callable[[], Awaitable[object]]]] = []
        if self.grpc:
            steps.append(("grpc", partial(self.grpc.stop, 2)))
        if self.rpc_server:
            steps.append(("rpc", partial(self.rpc_server.stop, 2)))
        if self.api:
            steps.append(("api", self.api.close))
        if self.engine:
            steps.append(("engine", partial(self.engine.stop, timeout)))
        if self.bus:
            steps.append(("nats", self.bus.close))
        if self.db:
            steps.append(("database", self.db.close))
        await shutdown_in_order(steps, timeout=timeout + 10)
        if self.metrics_server:
            self.metrics_server.stop()
