"""The model gateway: providers behind protection (limits, circuit breakers, retries, budgets), the
usage ledger, the prompt batcher and its drains, served over gRPC and NATS."""

from __future__ import annotations

import dataclasses
import os
import secrets
from collections.abc import Awaitable, Callable
from typing import Any

from parley.v1 import model_pb2
from parley.v1.scheduler_nats import SchedulerClient
from parley_platform.host import ServiceHost, ServiceSpec
from parley_platform.worker import WorkerHost

from .api import GatewayApi
from .batcher import Batcher
from .batching import load_config
from .config import GatewaySettings
from .drains import DrainTimer, ScheduledDrains
from .engine import Budgets, Engine, GatewayMetrics, Ledger
from .protection import RetryPolicy
from .providers import build_providers, preload, protect
from .store import MIGRATIONS_DIR, SCHEMA, GatewayStore

SPEC = ServiceSpec(
    "model-gateway",
    identity="model",
    grpc_port="gateway_grpc_port",
    metrics_port="gateway_metrics_port",
    schema=SCHEMA,
    migrations=MIGRATIONS_DIR,
)


def setup_with(environ: dict[str, str]) -> Callable[[ServiceHost[GatewaySettings]], Awaitable[None]]:
    async def setup(host: ServiceHost[GatewaySettings]) -> None:
        s = host.settings
        batcher_config = load_config(environ)
        routes, embedder = build_providers(s)
        providers = list({id(p): p for p in routes.values()}.values())
        if s.local_preload:
            preload(providers, embedder)
        store = GatewayStore(host.db)
        metrics = GatewayMetrics(host.registry)
        protected = {id(p): protect(s, p) for p in providers}
        ledger = Ledger(store, s.ledger_flush_ms / 1000)
        budgets = Budgets(
            store,
            default_tokens=s.budget_default_tokens,
            window_seconds=s.budget_window_seconds,
            cache_seconds=s.budget_cache_seconds,
        )
        engine = Engine(
            routes={model_type: protected[id(p)] for model_type, p in routes.items()},
            embedder=embedder,
            budgets=budgets,
            ledger=ledger,
            metrics=metrics,
            retry=RetryPolicy(s.retry_attempts, s.retry_base_delay_ms / 1000, s.retry_max_delay_ms / 1000),
            provider_timeout=s.provider_timeout_seconds,
            default_max_tokens=s.default_max_tokens,
        )
        ledger.start()
        bus = host.bus
        budget_subject = f"{bus.subjects.ns}.model.budget.changed"

        async def on_budget_changed(msg: Any) -> None:
            budgets.forget(msg.data.decode(errors="replace"))

        async def budget_changed(agent_id: str) -> None:
            budgets.forget(agent_id)
            await bus.publish_core(budget_subject, agent_id.encode())

        await bus.subscribe(budget_subject, on_budget_changed)
        batcher = Batcher(
            store=store,
            engine=engine,
            bus=bus,
            config=batcher_config,
            metrics=metrics,
            holder=f"gateway-{secrets.token_hex(4)}",
            lease_seconds=s.batcher_drain_lease_seconds,
        )
        drains = None
        if not s.batcher_self_drain:
            scheduler = SchedulerClient(host.rpc, timeout=s.batcher_scheduler_timeout_seconds)
            drains = ScheduledDrains(batcher, scheduler)
        api = GatewayApi(
            engine, batcher, budget_changed=budget_changed, section_added=drains.on_added if drains else None
        )
        host.serve(api, model_pb2, "ModelGateway")
        if drains is not None:
            host.component(
                "drain worker",
                WorkerHost(bus, service=SPEC.name, workers=drains.workers(), registry=host.registry),
            )
        else:
            host.component("drain timer", DrainTimer(batcher, s.batcher_tick_ms / 1000))
        host.on_stop("usage ledger", ledger.stop)
        for provider in providers:
            host.on_stop(f"provider {provider.name}", provider.close)
        host.on_stop("embedder", embedder.close)
        host.ready_fields.update(
            providers=",".join(sorted({f"{t}={p.name}" for t, p in routes.items()})),
            embeddings=f"{embedder.name}/{embedder.model}/{embedder.dimension}",
        )

    return setup


def create(settings: GatewaySettings, environ: dict[str, str] | None = None) -> ServiceHost[GatewaySettings]:
    spec = dataclasses.replace(
        SPEC, grpc_timeout=max(60.0, settings.provider_timeout_seconds * settings.retry_attempts)
    )
    return ServiceHost(spec, settings, setup_with(dict(os.environ if environ is None else environ)))
