"""The model gateway: providers behind protection (limits, circuit breakers, retries, budgets), the
usage ledger, the prompt batcher and its drains, served over gRPC and NATS."""

from __future__ import annotations

import dataclasses
import os
import secrets
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from parley.v1 import model_pb2
from parley_platform.host import ServiceHost, ServiceSpec
from parley_platform.worker import WorkerHost

from .api import MODEL_TYPES, GatewayApi
from .batcher import Batcher, DrainTimer
from .batching import load_config
from .config import GatewaySettings
from .drains import ScheduledDrains
from .engine import Budgets, Engine, GatewayMetrics, Ledger, Protected
from .local import LocalEmbedder, LocalProvider
from .protection import CircuitBreaker, Limiter, RetryPolicy
from .provider import Embedder, Provider
from .remote import AnthropicProvider, ModelNames, OpenAIEmbedder, OpenAIProvider
from .scripted import ScriptedEmbedder, ScriptedProvider, load_rules
from .store import MIGRATIONS_DIR, SCHEMA, GatewayStore


def _secret(value: Any) -> str:
    return value.get_secret_value() if value is not None else ""


def build_providers(settings: GatewaySettings) -> tuple[dict[str, Provider], Embedder]:
    """One provider object per name, shared by the model types routed to it, and the embedder."""
    wanted = {
        model_type: getattr(settings, f"model_provider_{model_type.lower()}") or settings.model_provider
        for model_type in MODEL_TYPES.values()
    }
    embedding = settings.embedding_provider or (
        "scripted" if settings.model_provider == "scripted" else "local"
    )
    made: dict[str, Provider] = {}
    names = set(wanted.values()) | ({"openai"} if embedding == "openai" else set())
    for name in sorted(names):
        if name == "scripted":
            rules = load_rules(settings.scripted_rules) if settings.scripted_rules else []
            made[name] = ScriptedProvider(rules=rules, latency_ms=settings.scripted_latency_ms)
        elif name == "local":
            made[name] = LocalProvider(
                settings.local_model_path,
                threads=settings.local_threads,
                context_tokens=settings.local_context_tokens,
            )
        elif name == "openai":
            made[name] = OpenAIProvider(
                base_url=settings.openai_base_url,
                api_key=_secret(settings.openai_api_key),
                models=ModelNames(settings.openai_model_small, settings.openai_model_large),
                embedding_model=settings.openai_embedding_model,
                embedding_dimension=settings.openai_embedding_dimension,
            )
        elif name == "anthropic":
            made[name] = AnthropicProvider(
                base_url=settings.anthropic_base_url,
                api_key=_secret(settings.anthropic_api_key),
                models=ModelNames(settings.anthropic_model_small, settings.anthropic_model_large),
            )
    embedder: Embedder
    if embedding == "openai":
        provider = made["openai"]
        assert isinstance(provider, OpenAIProvider)
        embedder = OpenAIEmbedder(provider)
    elif embedding == "local":
        embedder = LocalEmbedder()
    else:
        embedder = ScriptedEmbedder()
    return {model_type: made[name] for model_type, name in wanted.items()}, embedder


@dataclass
class _Started:
    """A part with a synchronous start and an asynchronous stop, as a host component."""

    start_now: Callable[[], None]
    stop_now: Callable[[], Awaitable[None]]

    async def start(self) -> None:
        self.start_now()

    async def stop(self, timeout: float) -> None:
        await self.stop_now()


SPEC = ServiceSpec(
    "model-gateway",
    grpc_port="gateway_grpc_port",
    metrics_port="gateway_metrics_port",
    schema=SCHEMA,
    migrations=MIGRATIONS_DIR,
)


def protect(settings: GatewaySettings, provider: Provider) -> Protected:
    """The local model runs one call at a time (one llama.cpp context); HTTP providers share the
    setting; the scripted model has its own, high limit."""
    limit = settings.provider_concurrency
    if isinstance(provider, LocalProvider):
        limit = 1
    elif isinstance(provider, ScriptedProvider):
        limit = settings.scripted_concurrency
    return Protected(
        provider,
        Limiter(provider.name, limit, settings.provider_queue_limit),
        CircuitBreaker(provider.name, settings.circuit_failure_threshold, settings.circuit_reset_seconds),
    )


def setup_with(environ: dict[str, str]) -> Callable[[ServiceHost[GatewaySettings]], Awaitable[None]]:
    async def setup(host: ServiceHost[GatewaySettings]) -> None:
        s = host.settings
        batcher_config = load_config(environ)
        routes, embedder = build_providers(s)
        providers = list({id(p): p for p in routes.values()}.values())
        if s.local_preload:
            for thing in [*providers, embedder]:
                if isinstance(thing, LocalProvider | LocalEmbedder):
                    thing.load()
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
        drains = None if s.batcher_self_drain else ScheduledDrains(batcher, host.rpc)
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
            timer = DrainTimer(batcher, s.batcher_tick_ms / 1000)
            host.component("drain timer", _Started(timer.start, timer.stop))
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
