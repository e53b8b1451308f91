"""One service process, declared once.

A service's ``app.py`` says what it is (a ``ServiceSpec``) and how to build its parts from
the connected infrastructure (a ``setup`` coroutine). The host does the rest, the same way
for every service:

start: check the operator token → migrate the service's schema → open the database pool →
connect to NATS (and make sure the standard streams exist) → ``setup(host)`` → serve the
declared APIs over NATS request/reply and gRPC (health, reflection, the token) → serve
metrics → start the components in order → log "ready".

stop (SIGINT/SIGTERM): stop the components in reverse order (intake first: consumers,
workers, loops) → stop gRPC and NATS serving (answering what was received) → run the
``on_stop`` steps (flushes) → close NATS → close the pool → stop the metrics server, all
within one shutdown budget.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from types import ModuleType
from typing import Any, Generic, Protocol, TypeVar

from grpc_health.v1 import health_pb2
from prometheus_client import CollectorRegistry

from . import codes
from .bus import Bus, tls_context
from .errors import ParleyError
from .grpcserver import GrpcServer, ServerTls, start_grpc_server
from .lifecycle import run_app, shutdown_in_order
from .logging import get_logger
from .metrics import MessagingMetrics, MetricsServer, serve
from .outage import Dependencies
from .postgres import Database, migrate
from .rpc import RpcClient, RpcServer
from .service import grpc_binding, nats_name, register_nats
from .settings import Settings

log = get_logger(__name__)

PROBE_INTERVAL = 2.0  # seconds between the host's probes of PostgreSQL and NATS
PROBE_TIMEOUT = 5.0
PROBE_FAILURES = 2  # consecutive failed probes before a dependency is reported down

S = TypeVar("S", bound=Settings)
Step = Callable[[], Awaitable[object]]


class Component(Protocol):
    """Something the host starts after the APIs are served and stops first (consumers, workers).

    A component may also have ``stop_taking_work()``: at the start of shutdown the host calls it
    on every component at once, so they all stop taking new work together (each consumer's idle
    fetch runs out in parallel) before they are stopped one by one in reverse start order."""

    async def start(self) -> None: ...
    async def stop(self, timeout: float) -> None: ...


@dataclass(frozen=True)
class ServiceSpec:
    name: str  # logs, metrics, the NATS connection and the database pool are named after it
    identity: str  # its NATS user, whose permissions are in parley_platform.permissions
    grpc_port: str  # the settings field of its gRPC port, e.g. "authz_grpc_port"
    metrics_port: str  # the settings field of its metrics port
    schema: str | None = None  # its PostgreSQL schema, migrated at start
    migrations: Path | None = None
    standard_streams: bool = False  # make sure INBOUND, OUTBOUND, EVENTS and DEAD exist
    grpc_timeout: float = 60.0  # the longest a gRPC call may take, whatever the caller's deadline
    # The services it calls over NATS: their parley_dependency_up gauges exist from the start.
    depends_on: tuple[str, ...] = ()


@dataclass
class _Loop:
    """A background coroutine run for the life of the process, cancelled at shutdown."""

    name: str
    run: Callable[[], Coroutine[Any, Any, None]]
    task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self.task = asyncio.create_task(self.run(), name=self.name)
        self.task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and (exc := task.exception()) is not None:
            log.error("background loop stopped", loop=self.name, error=repr(exc))

    async def stop(self, timeout: float) -> None:
        if self.task is not None and not self.task.done():
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.task


@dataclass
class _Api:
    impl: Any
    pb2: ModuleType
    service: str
    over_nats: bool


@dataclass
class ServiceHost(Generic[S]):
    spec: ServiceSpec
    settings: S
    setup: Callable[[ServiceHost[S]], Awaitable[None]]
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)
    ready_fields: dict[str, object] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.messaging = MessagingMetrics(self.registry)
        known = ("nats", *(("postgres",) if self.spec.schema else ()), *self.spec.depends_on)
        self.dependencies = Dependencies(self.registry, known=known)
        self.dependencies.listen(self._report_health)
        self._health_tasks: set[asyncio.Task[None]] = set()
        self._failed_probes: dict[str, int] = {}
        self._db: Database | None = None
        self._bus: Bus | None = None
        self._apis: list[_Api] = []
        self._components: list[tuple[str, Component]] = []
        self._started: list[tuple[str, Component]] = []
        self._on_stop: list[tuple[str, Step]] = []
        self._rpc_servers: list[RpcServer] = []
        self._grpc: GrpcServer | None = None
        self._metrics: MetricsServer | None = None

    # -- what setup uses ---------------------------------------------------------------------

    @property
    def db(self) -> Database:
        if self._db is None:
            raise RuntimeError(f"{self.spec.name} has no database (ServiceSpec.schema is not set)")
        return self._db

    @property
    def bus(self) -> Bus:
        if self._bus is None:
            raise RuntimeError("NATS is not connected yet")
        return self._bus

    @property
    def rpc(self) -> RpcClient:
        return RpcClient(self.bus)

    def serve(self, impl: Any, pb2: ModuleType, service: str, *, over_nats: bool = True) -> None:
        """Serve a protobuf service of ``pb2`` (every method an async method of ``impl``)."""
        self._apis.append(_Api(impl, pb2, service, over_nats))

    def component(self, name: str, component: Component) -> None:
        """Started in declaration order once the APIs are served; stopped first, in reverse."""
        self._components.append((name, component))

    def loop(self, name: str, run: Callable[[], Coroutine[Any, Any, None]]) -> None:
        """A background coroutine (a sweeper, a poller), cancelled at shutdown."""
        self.component(name, _Loop(name, run))

    def every(self, name: str, seconds: float, step: Step) -> None:
        """Run ``step`` now and then every ``seconds``. A failing step (the database or NATS away)
        is logged and tried again at the next tick; it never stops the loop."""

        async def run() -> None:
            while True:
                try:
                    await step()
                except ParleyError as exc:
                    log.warning("periodic step failed; retrying", step=name, code=exc.code, error=exc.message)
                await asyncio.sleep(seconds)

        self.loop(name, run)

    def on_stop(self, name: str, step: Step) -> None:
        """A flush run after serving stopped and before NATS and the database close."""
        self._on_stop.append((name, step))

    # -- dependencies ------------------------------------------------------------------------

    def _report_health(self, missing: list[str]) -> None:
        """NOT_SERVING (overall, the empty service name) while a dependency is missing."""
        if self._grpc is None:
            return
        status = (
            health_pb2.HealthCheckResponse.NOT_SERVING if missing else health_pb2.HealthCheckResponse.SERVING
        )
        task = asyncio.get_running_loop().create_task(self._grpc.health.set("", status))
        self._health_tasks.add(task)
        task.add_done_callback(self._health_tasks.discard)

    async def _probe(self, name: str, check: Step) -> None:
        try:
            await check()
        except ParleyError as exc:
            failures = self._failed_probes.get(name, 0) + 1
            self._failed_probes[name] = failures
            if failures >= PROBE_FAILURES:
                self.dependencies.down(name, str(exc)[:300], probed=True)
            return
        self._failed_probes[name] = 0
        self.dependencies.up(name, how="probe")

    async def _probe_infrastructure(self) -> None:
        """PostgreSQL and NATS, watched by the host itself (the services it calls are found down
        by the consumers whose messages need them)."""
        if self._db is not None:
            await self._probe("postgres", partial(self._db.ping, PROBE_TIMEOUT))
        await self._probe("nats", self._nats_connected)

    async def _nats_connected(self) -> None:
        if not self.bus.nc.is_connected:
            raise codes.NATS_UNAVAILABLE("not connected to NATS")

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        s, spec = self.settings, self.spec
        if s.operator_token is None:
            raise codes.OPERATOR_TOKEN_REQUIRED("PARLEY_OPERATOR_TOKEN is not set")
        if spec.schema is not None:
            assert spec.migrations is not None, "a schema needs its migrations directory"
            await migrate(s.database_url, spec.schema, spec.migrations)
            self._db = Database(
                s.database_url, name=spec.name, min_size=s.db_pool_min, max_size=s.db_pool_max
            )
            await self._db.open()
        user, password = nats_credentials(s, spec.identity)
        self._bus = await Bus.connect(
            s.nats_url,
            name=spec.name,
            namespace=s.namespace,
            user=user,
            password=password,
            tls=tls_context(s.nats_tls_ca, s.nats_tls_cert, s.nats_tls_key),
        )
        if spec.standard_streams:
            await self._bus.ensure_standard_streams(replicas=s.stream_replicas)
        await self.setup(self)
        await self._serve_nats()
        self._grpc = await start_grpc_server(
            [grpc_binding(api.impl, api.pb2, api.service) for api in self._apis],
            host=s.grpc_host,
            port=getattr(s, spec.grpc_port),
            token=s.operator_token.get_secret_value(),
            default_timeout=spec.grpc_timeout,
            tls=ServerTls(s.grpc_tls_cert, s.grpc_tls_key) if s.grpc_tls_cert and s.grpc_tls_key else None,
        )
        self._metrics = serve(
            self.registry,
            s.metrics_host,
            getattr(s, spec.metrics_port),
            port_setting=f"PARLEY_{spec.metrics_port.upper()}",
        )
        self.every("dependency probes", PROBE_INTERVAL, self._probe_infrastructure)
        for name, component in self._components:
            await component.start()
            self._started.append((name, component))
        log.info(
            f"{spec.name} ready",
            grpc_port=self._grpc.port,
            metrics_port=self._metrics.port,
            namespace=s.namespace,
            **self.ready_fields,
        )

    async def _serve_nats(self) -> None:
        servers: dict[str, RpcServer] = {}
        for api in self._apis:
            if not api.over_nats:
                continue
            name = nats_name(api.pb2, api.service)
            if name not in servers:
                servers[name] = RpcServer(self.bus, name, metrics=self.messaging)
            register_nats(servers[name], api.impl, api.pb2, api.service)
        for server in servers.values():
            await server.start()
            self._rpc_servers.append(server)

    async def stop(self) -> None:
        timeout = self.settings.shutdown_timeout_seconds
        for _, component in self._started:
            stop_taking_work = getattr(component, "stop_taking_work", None)
            if stop_taking_work is not None:
                stop_taking_work()
        steps: list[tuple[str, Step]] = [
            (name, partial(component.stop, timeout)) for name, component in reversed(self._started)
        ]
        if self._grpc is not None:
            steps.append(("grpc", partial(self._grpc.stop, 2)))
        steps += [(f"rpc {server.service}", partial(server.stop, 5)) for server in self._rpc_servers]
        steps += self._on_stop
        if self._bus is not None:
            steps.append(("nats", self._bus.close))
        if self._db is not None:
            steps.append(("database", self._db.close))
        await shutdown_in_order(steps, timeout=timeout + 10)
        if self._metrics is not None:
            self._metrics.stop()


def nats_credentials(settings: Settings, identity: str) -> tuple[str, str | None]:
    """The NATS user and password of a service: PARLEY_NATS_USER / PARLEY_NATS_PASSWORD, else its
    identity's own variable, PARLEY_<IDENTITY>_NATS_PASSWORD (so one environment can hold every
    service's password, as ``make run`` and the tests give it)."""
    if settings.nats_password is not None:
        return settings.nats_user or identity, settings.nats_password.get_secret_value()
    user = settings.nats_user or identity
    return user, os.environ.get(f"PARLEY_{user.upper()}_NATS_PASSWORD")


def run_service(spec: ServiceSpec, settings: S, setup: Callable[[ServiceHost[S]], Awaitable[None]]) -> int:
    """``python -m parley_<service>``: run one replica until SIGINT/SIGTERM."""
    return run_app(spec.name, lambda: (ServiceHost(spec, settings, setup), settings))
