"""Wiring of the runtime service: start in order, stop in reverse."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

from prometheus_client import CollectorRegistry

from parley.v1 import documents_pb2, documents_pb2_grpc, runtime_pb2, runtime_pb2_grpc
from parley_platform.bus import Bus, ConsumerSpec
from parley_platform.consumer import PullConsumer
from parley_platform.errors import InvalidArgument, ParleyError
from parley_platform.grpcserver import GrpcServer, start_grpc_server
from parley_platform.lifecycle import shutdown_in_order
from parley_platform.logging import get_logger
from parley_platform.metrics import MessagingMetrics, MetricsServer, serve
from parley_platform.postgres import Database, migrate
from parley_platform.rpc import RpcClient, RpcServer
from parley_platform.service import grpc_binding, register_nats
from parley_platform.worker import WorkerHost

from .agent_settings import trajectory_logging_enabled
from .agents import AgentDirectory
from .api import API_SOURCE, ReplyWaiters, RuntimeApi
from .character import load_characters
from .config import RuntimeSettings
from .confirmations import CLAIMED, SETTLED
from .custom.service import CustomActionsService
from .documents import DocumentsApi, DocumentStore
from .secrets import SecretBox, check_salt
from .store import MIGRATIONS_DIR, SCHEMA, RuntimeStore
from .tasks import cancel, runtime_workers, spawn_ensure_tasks
from .turn import TurnMetrics, TurnProcessor, TurnSettings

log = get_logger(__name__)

SERVICE = "runtime"


class RuntimeApp:
    def __init__(self, settings: RuntimeSettings) -> None:
        self.settings = settings
        self.registry = CollectorRegistry()
        self.grpc: GrpcServer | None = None
        self.metrics_server: MetricsServer | None = None
        self.consumer: PullConsumer | None = None
        self.event_consumers: list[PullConsumer] = []
        self.turns: TurnProcessor | None = None
        self.workers: WorkerHost | None = None
        self.ensure_tasks: asyncio.Task[None] | None = None
        self.rpc_server: RpcServer | None = None
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
        characters = load_characters(s.characters_dir)
        if not characters:
            raise InvalidArgument(
                f"no character files in {s.characters_dir}",
                code="NO_CHARACTERS",
                hint="add a YAML character, e.g. characters/default.yaml",
            )
        salt = check_salt(
            s.secret_salt.get_secret_value() if s.secret_salt else None,
            environment=s.environment.value,
            allow_default=s.allow_default_secret_salt,
        )
        trajectory_logging = trajectory_logging_enabled(s.trajectory_logging, s.environment.value)
        await migrate(s.database_url, SCHEMA, MIGRATIONS_DIR)
        self.db = Database(s.database_url, name=SERVICE, min_size=s.db_pool_min, max_size=s.db_pool_max)
        await self.db.open()
        self.store = RuntimeStore(self.db)
        self.directory = AgentDirectory(self.store, SecretBox(salt), {})
        for character in characters:
            await self.directory.save(character)
        log.info(
            "agents loaded",
            agents=",".join(c.name for c in characters),
            trajectory_logging=trajectory_logging,
        )

        self.bus = await Bus.connect(s.nats_url, name=SERVICE, namespace=s.namespace)
        await self.bus.ensure_standard_streams()
        messaging = MessagingMetrics(self.registry)
        self.turns = TurnProcessor(
            store=self.store,
            bus=self.bus,
            rpc=RpcClient(self.bus),
            directory=self.directory,
            metrics=TurnMetrics(self.registry),
            settings=TurnSettings(
                max_text_bytes=s.max_text_bytes,
                max_deliver=s.max_deliver,
                model_timeout=s.model_timeout_seconds,
                history=s.recent_messages,
                provider_timeout=s.provider_timeout_seconds,
                trajectory_logging=trajectory_logging,
                embed_messages=s.embed_messages,
            ),
        )
        subjects = self.bus.subjects
        self.waiters = ReplyWaiters()
        self.reply_sub = await self.bus.subscribe(subjects.outbound("*", API_SOURCE), self.waiters.on_message)
        changes = subjects.rpc(SERVICE, "agents.changed")

        async def announce(agent_id: str) -> None:
            await self.bus.publish_core(changes, agent_id.encode())  # type: ignore[union-attr]

        async def on_change(msg: Any) -> None:
            with contextlib.suppress(ParleyError):
                await self.directory.on_changed(msg.data.decode(errors="replace"))

        self.directory.connect(announce)
        self.custom = CustomActionsService.create(s, self.db, self.directory)
        self.changes_sub = await self.bus.subscribe(changes, on_change)
        self.api = RuntimeApi(
            store=self.store,
            bus=self.bus,
            directory=self.directory,
            waiters=self.waiters,
            embed=self.turns.embed,
        )
        self.rpc_server = RpcServer(self.bus, SERVICE, metrics=messaging)
        register_nats(self.rpc_server, self.api, runtime_pb2, "Runtime")
        self.custom.register_nats(self.rpc_server)
        self.documents = DocumentsApi(
            store=DocumentStore(self.db), directory=self.directory, embed=self.turns.embed
        )
        register_nats(self.rpc_server, self.documents, documents_pb2, "Documents")
        await self.rpc_server.start()
        self.grpc = await start_grpc_server(
            [
                grpc_binding(self.api, runtime_pb2, runtime_pb2_grpc, "Runtime"),
                grpc_binding(self.documents, documents_pb2, documents_pb2_grpc, "Documents"),
                self.custom.grpc_binding(),
            ],
            host=s.grpc_host,
            port=s.runtime_grpc_port,
            token=s.operator_token.get_secret_value(),
        )
        self.consumer = PullConsumer(
            self.bus,
            ConsumerSpec(
                stream=subjects.stream("INBOUND"),
                durable="runtime",
                filter_subject=subjects.all("inbound"),
                ack_wait_seconds=s.ack_wait_seconds,
                max_deliver=s.max_deliver,
            ),
            self.custom.before_turns(self.turns.handle),
            concurrency=s.turn_concurrency,
            metrics=messaging,
            on_exhausted=self.turns.exhausted,
        )
        await self.consumer.start()
        # Approved actions run, and confirmed conversations continue, on whichever replica
        # receives authz's event (confirmations.py).
        for event_type in (CLAIMED, SETTLED):
            events = PullConsumer(
                self.bus,
                ConsumerSpec(
                    stream=subjects.stream("EVENTS"),
                    durable=f"runtime-{event_type.lower().replace('_', '-')}",
                    filter_subject=subjects.events("*", event_type),
                    ack_wait_seconds=s.ack_wait_seconds,
                    max_deliver=s.max_deliver,
                ),
                self.custom.before_events(self.turns.confirmations.on_event),
                concurrency=16,
                metrics=messaging,
            )
            await events.start()
            self.event_consumers.append(events)
        self.workers = WorkerHost(
            self.bus,
            service=SERVICE,
            workers=runtime_workers(self.store, self.turns.embed),
            registry=self.registry,
        )
        await self.workers.start()
        self.ensure_tasks = spawn_ensure_tasks(
            RpcClient(self.bus), [a.id for a in self.directory.agents.values()]
        )
        self.metrics_server = serve(
            self.registry, s.metrics_host, s.runtime_metrics_port, port_setting="PARLEY_RUNTIME_METRICS_PORT"
        )
        log.info(
            "runtime ready",
            grpc_port=self.grpc.port,
            metrics_port=self.metrics_server.port,
            namespace=s.namespace,
        )

    async def stop(self) -> None:
        timeout = self.settings.shutdown_timeout_seconds
        steps: list[tuple[str, Callable[[], Awaitable[object]]]] = []
        if self.consumer:
            steps.append(("consumer", partial(self.consumer.stop, timeout)))
        for events in self.event_consumers:
            steps.append((events.spec.durable, partial(events.stop, timeout)))
        steps.append(("runtime tasks", partial(cancel, self.ensure_tasks)))
        if self.workers:
            steps.append(("workers", partial(self.workers.stop, timeout)))
        if self.turns:
            steps.append(("evaluators", partial(self.turns.drain, 5)))
        if self.grpc:
            steps.append(("grpc", partial(self.grpc.stop, 2)))
        if self.rpc_server:
            steps.append(("rpc", partial(self.rpc_server.stop, 2)))
        if self.bus:
            steps.append(("nats", self.bus.close))
        if self.db:
            steps.append(("database", self.db.close))
        await shutdown_in_order(steps, timeout=timeout + 5)
        if self.metrics_server:
            self.metrics_server.stop()
