"""The runtime service: agents, the inbound consumer that runs turns, confirmations, custom
actions, documents, and the runtime's own scheduled work."""

from __future__ import annotations

import contextlib
from typing import Any

from parley.v1 import actions_pb2, documents_pb2, runtime_pb2
from parley.v1.scheduler_nats import SchedulerClient
from parley_platform.bus import ConsumerSpec
from parley_platform.consumer import PullConsumer
from parley_platform.errors import ParleyError
from parley_platform.host import ServiceHost, ServiceSpec
from parley_platform.logging import get_logger
from parley_platform.worker import WorkerHost

from . import errors
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
from .tasks import ensure_tasks, runtime_workers
from .turn import TurnMetrics, TurnProcessor, TurnSettings

log = get_logger(__name__)

SPEC = ServiceSpec(
    "runtime",
    grpc_port="runtime_grpc_port",
    metrics_port="runtime_metrics_port",
    schema=SCHEMA,
    migrations=MIGRATIONS_DIR,
    standard_streams=True,
)


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
    bus = host.bus
    turns = TurnProcessor(
        store=store,
        bus=bus,
        rpc=host.rpc,
        directory=directory,
        metrics=TurnMetrics(host.registry),
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
    custom = CustomActionsService.create(s, host.db, directory)
    host.serve(
        RuntimeApi(store=store, bus=bus, directory=directory, waiters=waiters, embed=turns.embed),
        runtime_pb2,
        "Runtime",
    )
    host.serve(custom.api, actions_pb2, "CustomActions")
    host.serve(
        DocumentsApi(store=DocumentStore(host.db), directory=directory, embed=turns.embed),
        documents_pb2,
        "Documents",
    )

    host.component(
        "consumer",
        PullConsumer(
            bus,
            ConsumerSpec(
                stream=subjects.stream("INBOUND"),
                durable="runtime",
                filter_subject=subjects.all("inbound"),
                ack_wait_seconds=s.ack_wait_seconds,
                max_deliver=s.max_deliver,
            ),
            custom.before_turns(turns.handle),
            concurrency=s.turn_concurrency,
            metrics=host.messaging,
            on_exhausted=turns.exhausted,
        ),
    )
    # Approved actions run, and confirmed conversations continue, on whichever replica
    # receives authz's event (confirmations.py).
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
                custom.before_events(turns.confirmations.on_event),
                concurrency=16,
                metrics=host.messaging,
            ),
        )
    host.component(
        "workers",
        WorkerHost(
            bus, service=SPEC.name, workers=runtime_workers(store, turns.embed), registry=host.registry
        ),
    )
    scheduler = SchedulerClient(host.rpc, timeout=5)
    host.loop("runtime tasks", lambda: ensure_tasks(scheduler, [a.id for a in directory.agents.values()]))
    host.on_stop("evaluators", lambda: turns.drain(5))
