"""The runtime service: agents, the inbound consumer that runs turns, confirmations, custom
actions, documents, and the runtime's own scheduled work."""

from __future__ import annotations

import contextlib
from typing import Any

from parley.v1 import actions_pb2, dead_pb2, documents_pb2, mcp_pb2, runtime_pb2
from parley.v1.authz_nats import AuthzClient
from parley.v1.model_nats import ModelGatewayClient
from parley.v1.scheduler_nats import SchedulerClient
from parley_clients.pairing import PairingGate
from parley_platform.bus import ConsumerSpec
from parley_platform.consumer import PullConsumer
from parley_platform.deadletters import DeadLetters
from parley_platform.errors import ParleyError
from parley_platform.host import ServiceHost, ServiceSpec
from parley_platform.logging import get_logger
from parley_platform.service import Combined
from parley_platform.worker import WorkerHost

from . import errors
from .agent_settings import trajectory_logging_enabled
from .agents.custom_actions import CustomActionRegistry
from .agents.custom_api import CustomActionsApi
from .agents.custom_store import CustomActionStore
from .agents.directory import AgentDirectory
from .agents.plugin_services import PluginServices
from .api import API_SOURCE, ReplyWaiters, RuntimeApi
from .autonomy.service import Autonomy, Defaults
from .autonomy.store import AutonomyStore
from .character import load_characters
from .config import RuntimeSettings
from .custom.executor import CustomActionSettings, Executor, load_config_file
from .documents.api import DocumentsApi
from .documents.character_knowledge import CharacterKnowledge
from .documents.store import DocumentStore
from .mcp.api import McpApi
from .mcp.registry import McpRegistry, McpSettings
from .secrets import SecretBox, check_salt
from .store import MIGRATIONS_DIR, SCHEMA, RuntimeStore
from .tasks import ensure_tasks, runtime_workers
from .turn.approvals import Approvals
from .turn.confirmations import CLAIMED, SETTLED, Confirmations
from .turn.control import CancelTurnApi, TurnControl
from .turn.evaluation import EvaluatorBatchers
from .turn.ports import Events, Inbox, Model, Outbox, Ports
from .turn.processor import TurnProcessor
from .turn.services import Resources
from .turn.state import TurnMetrics, TurnSettings
from .turn.streaming import ChunkPublisher, RunningTurns

log = get_logger(__name__)

SPEC = ServiceSpec(
    "runtime",
    identity="runtime",
    grpc_port="runtime_grpc_port",
    metrics_port="runtime_metrics_port",
    schema=SCHEMA,
    migrations=MIGRATIONS_DIR,
    standard_streams=True,
    depends_on=("model", "authz", "pairing"),
)


def custom_actions(
    s: RuntimeSettings, store: CustomActionStore, directory: AgentDirectory
) -> CustomActionRegistry:
    config = (
        [d for d in load_config_file(s.custom_actions_file) if d.enabled] if s.custom_actions_file else []
    )
    executor = Executor(
        CustomActionSettings(
            allow_hosts=tuple(h for h in s.custom_actions_allow_hosts.split(",") if h.strip()),
            shell_enabled=s.custom_actions_shell,
            code_enabled=s.custom_actions_code,
        )
    )
    log.info(
        "custom actions ready",
        config_actions=len(config),
        shell=s.custom_actions_shell,
        code=s.custom_actions_code,
    )
    return CustomActionRegistry(store, directory, executor, config)


async def setup(host: ServiceHost[RuntimeSettings]) -> None:
    s = host.settings
    characters = load_characters(s.characters_dir)
    if not characters:
        raise errors.NO_CHARACTERS(f"no character files in {s.characters_dir}")
    salt = check_salt(
        s.secret_salt.get_secret_value() if s.secret_salt else None,
        environment=s.environment.value,
        allow_default=s.allow_default_secret_salt,
    )
    trajectory_logging = trajectory_logging_enabled(s.trajectory_logging, s.environment.value)
    store = RuntimeStore(host.db)
    directory = AgentDirectory(store, SecretBox(salt), {})
    for character in characters:
        await directory.save(character)
    log.info(
        "agents loaded", agents=",".join(c.name for c in characters), trajectory_logging=trajectory_logging
    )
    bus, rpc = host.bus, host.rpc
    authz = AuthzClient(rpc, timeout=s.authz_timeout_seconds)
    batchers = EvaluatorBatchers(bus, timeout=s.model_timeout_seconds) if s.evaluator_batching else None
    model = Model(
        ModelGatewayClient(rpc, timeout=s.model_timeout_seconds),
        batchers,
        batch_window=s.evaluator_batch_window_ms / 1000,
    )
    ports = Ports(
        model=model,
        outbox=Outbox(bus),
        inbox=Inbox(bus),
        events=Events(bus),
        authz=authz,
        pairing=PairingGate(rpc, timeout=s.pairing_timeout_seconds),
        chunks=ChunkPublisher(bus),
    )
    resources = Resources(store, DocumentStore(host.db), model, Approvals(authz, store))
    # The characters' knowledge texts become their agents' documents, in the background.
    knowledge = CharacterKnowledge(resources.documents, model.embed)
    directory.on_loaded(knowledge.on_loaded)
    for served in directory.agents.values():
        knowledge.load(served.id, served.character)
    host.on_stop("character knowledge", lambda: knowledge.drain(5))
    metrics = TurnMetrics(host.registry)
    running = RunningTurns()
    control = TurnControl(bus, running)
    await control.start()
    registry = custom_actions(s, CustomActionStore(host.db), directory)
    turns = TurnProcessor(
        catalogs=registry.refresh,  # at the revision the ingest statement read
        running=running,
        control=control,
        resources=resources,
        ports=ports,
        directory=directory,
        metrics=metrics,
        settings=TurnSettings(
            max_text_bytes=s.max_text_bytes,
            max_deliver=s.max_deliver,
            model_timeout=s.model_timeout_seconds,
            history=s.recent_messages,
            provider_timeout=s.provider_timeout_seconds,
            trajectory_logging=trajectory_logging,
            embed_messages=s.embed_messages,
            embedding_window=s.embedding_batch_window_ms / 1000,
        ),
    )
    confirmations = Confirmations(resources=resources, ports=ports, directory=directory, metrics=metrics)

    subjects = bus.subjects
    waiters = ReplyWaiters()
    await bus.subscribe(subjects.outbound("*", API_SOURCE), waiters.on_message)
    changes = subjects.rpc(SPEC.name, "agents.changed")

    async def announce(agent_id: str) -> None:
        await bus.publish_core(changes, agent_id.encode())

    async def on_change(msg: Any) -> None:
        with contextlib.suppress(ParleyError):
            await directory.on_changed(msg.data.decode(errors="replace"))

    directory.connect(announce)
    await bus.subscribe(changes, on_change)
    autonomy = Autonomy(
        store=AutonomyStore(host.db),
        bus=bus,
        directory=directory,
        inbox=ports.inbox,
        registry=host.registry,
        defaults=Defaults(s.autonomy_interval_ms, s.autonomy_model_size),
        stale_seconds=s.ack_wait_seconds,
        timeout=s.model_timeout_seconds,
    )
    api = RuntimeApi(
        store=store, bus=bus, directory=directory, waiters=waiters, embed=model.embed, autonomy=autonomy
    )
    host.serve(
        Combined(api, CancelTurnApi(control, api.find_agent)),
        runtime_pb2,
        "Runtime",
    )
    host.serve(CustomActionsApi(directory, registry), actions_pb2, "CustomActions")
    host.serve(
        DocumentsApi(store=resources.documents, agents=directory, embed=model.embed),
        documents_pb2,
        "Documents",
    )

    async def agent_id(ref: str) -> str | None:
        agent = await directory.find(ref)
        return str(agent.id) if agent else None

    # The operator's: NATS permissions let no other identity publish to these subjects.
    host.serve(DeadLetters(bus, agent_id), dead_pb2, "DeadLetters")
    plugin_services = PluginServices(
        directory, authz=authz, registry=host.registry, lease_ttl_ms=s.plugin_service_lease_ms
    )
    ports.events.listeners.append(plugin_services.dispatch)
    host.component("plugin services", plugin_services)
    mcp = McpRegistry(
        directory,
        McpSettings(
            stdio_enabled=s.mcp_stdio,
            confirm_destructive=s.mcp_confirm_destructive,
            allow_hosts=tuple(h.strip() for h in s.mcp_allow_hosts.split(",") if h.strip()),
            call_timeout=s.mcp_call_timeout_seconds,
        ),
        plugin_services.on_agent,
    )
    host.serve(McpApi(directory, mcp), mcp_pb2, "Mcp")
    host.component("mcp", mcp)
    host.component("autonomy", autonomy)
    host.component(
        "consumer",
        PullConsumer(
            bus,
            ConsumerSpec(
                stream=subjects.stream("INBOUND"),
                durable="runtime",
                filter_subject="",  # connectors' messages and the runtime's own (self)
                ack_wait_seconds=s.ack_wait_seconds,
                max_deliver=s.max_deliver,
            ),
            mcp.before_turns(turns.handle),
            concurrency=s.turn_concurrency,
            metrics=host.messaging,
            on_exhausted=turns.exhausted,
            dependencies=host.dependencies,
        ),
    )
    # Approved actions run, and confirmed conversations continue, on whichever replica receives
    # authz's event.
    for event_type in (CLAIMED, SETTLED):
        durable = f"runtime-{event_type.lower().replace('_', '-')}"
        host.component(
            durable,
            PullConsumer(
                bus,
                ConsumerSpec(
                    stream=subjects.stream("EVENTS"),
                    durable=durable,
                    filter_subject=subjects.events("*", event_type),
                    ack_wait_seconds=s.ack_wait_seconds,
                    max_deliver=s.max_deliver,
                ),
                mcp.before_turns(registry.before_turns(confirmations.on_event)),
                concurrency=16,
                metrics=host.messaging,
                dependencies=host.dependencies,
            ),
        )
    workers = runtime_workers(store, model.embed)
    host.component("workers", WorkerHost(bus, service=SPEC.name, workers=workers, registry=host.registry))
    scheduler = SchedulerClient(rpc, timeout=5)
    host.loop("runtime tasks", lambda: ensure_tasks(scheduler, [a.id for a in directory.agents.values()]))
    host.on_stop("evaluators", lambda: turns.drain(5))
    if batchers is not None:  # after the evaluators: they use it
        host.on_stop("evaluator batchers", batchers.close)
