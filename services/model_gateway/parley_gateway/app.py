"""Wiring of the model gateway: start in order, stop in reverse."""

from __future__ import annotations

import os
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable
from functools import partial
from typing import Any

import grpc
from prometheus_client import CollectorRegistry

from parley.v1 import model_pb2, model_pb2_grpc
from parley_platform.bus import Bus
from parley_platform.errors import DeadlineExceeded, InvalidArgument, ParleyError
from parley_platform.grpcserver import ERROR_METADATA_KEY, GrpcServer, ServiceBinding, start_grpc_server
from parley_platform.lifecycle import shutdown_in_order
from parley_platform.logging import get_logger
from parley_platform.metrics import MessagingMetrics, MetricsServer, serve
from parley_platform.postgres import Database, migrate
from parley_platform.rpc import RpcClient, RpcServer
from parley_platform.service import grpc_binding, register_nats
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

log = get_logger(__name__)

SERVICE = "model"


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


def _stream_binding(api: GatewayApi, binding: ServiceBinding) -> ServiceBinding:
    """GenerateStream as an async generator with the same error mapping as the unary calls."""

    async def generate_stream(
        request: Any, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[Any]:
        remaining = context.time_remaining()
        try:
            stream = api.GenerateStream(request)
            if remaining is None:
                async for chunk in stream:
                    yield chunk
            else:
                import asyncio

                async with asyncio.timeout(remaining):
                    async for chunk in stream:
                        yield chunk
        except ParleyError as exc:
            await _abort(context, exc)
        except TimeoutError:
            await _abort(
                context, DeadlineExceeded("GenerateStream did not finish within the caller's deadline")
            )

    binding.servicer.GenerateStream = generate_stream
    return binding


async def _abort(context: grpc.aio.ServicerContext[Any, Any], exc: ParleyError) -> None:
    context.set_trailing_metadata(((ERROR_METADATA_KEY, exc.to_proto().SerializeToString()),))
    message = exc.message + (f" (hint: {exc.hint})" if exc.hint else "")
    await context.abort(exc.grpc_status, f"{exc.code}: {message}")


class GatewayApp:
    def __init__(self, settings: GatewaySettings, environ: dict[str, str] | None = None) -> None:
        self.settings = settings
        self.environ = dict(os.environ if environ is None else environ)
        self.registry = CollectorRegistry()
        self.grpc: GrpcServer | None = None
        self.metrics_server: MetricsServer | None = None
        self.bus: Bus | None = None
        self.rpc_server: RpcServer | None = None
        self.db: Database | None = None
        self.ledger: Ledger | None = None
        self.timer: DrainTimer | None = None
        self.drain_workers: WorkerHost | None = None
        self.providers: list[Provider] = []
        self.embedder: Embedder | None = None
        self.budget_sub: Any = None

    async def start(self) -> None:
        s = self.settings
        if s.operator_token is None:
            raise InvalidArgument(
                "PARLEY_OPERATOR_TOKEN is not set",
                code="OPERATOR_TOKEN_REQUIRED",
                hint="`parley run` sets one for you; otherwise choose a long random string",
            )
        batcher_config = load_config(self.environ)
        routes, embedder = build_providers(s)
        self.providers = list({id(p): p for p in routes.values()}.values())
        self.embedder = embedder
        if s.local_preload:
            for thing in [*self.providers, embedder]:
                if isinstance(thing, LocalProvider | LocalEmbedder):
                    thing.load()

        await migrate(s.database_url, SCHEMA, MIGRATIONS_DIR)
        self.db = Database(
            s.database_url, name="model-gateway", min_size=s.db_pool_min, max_size=s.db_pool_max
        )
        await self.db.open()
        store = GatewayStore(self.db)
        metrics = GatewayMetrics(self.registry)
        protected: dict[int, Protected] = {}
        for provider in self.providers:
            # The local model runs one call at a time (one llama.cpp context); HTTP providers share
            # the setting; the scripted model has its own, high limit.
            limit = s.provider_concurrency
            if isinstance(provider, LocalProvider):
                limit = 1
            elif isinstance(provider, ScriptedProvider):
                limit = s.scripted_concurrency
            protected[id(provider)] = Protected(
                provider,
                Limiter(provider.name, limit, s.provider_queue_limit),
                CircuitBreaker(provider.name, s.circuit_failure_threshold, s.circuit_reset_seconds),
            )
        self.ledger = Ledger(store, s.ledger_flush_ms / 1000)
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
            ledger=self.ledger,
            metrics=metrics,
            retry=RetryPolicy(s.retry_attempts, s.retry_base_delay_ms / 1000, s.retry_max_delay_ms / 1000),
            provider_timeout=s.provider_timeout_seconds,
            default_max_tokens=s.default_max_tokens,
        )
        self.ledger.start()

        self.bus = await Bus.connect(s.nats_url, name="model-gateway", namespace=s.namespace)
        budget_subject = f"{self.bus.subjects.ns}.model.budget.changed"

        async def on_budget_changed(msg: Any) -> None:
            budgets.forget(msg.data.decode(errors="replace"))

        async def budget_changed(agent_id: str) -> None:
            budgets.forget(agent_id)
            assert self.bus is not None
            await self.bus.publish_core(budget_subject, agent_id.encode())

        self.budget_sub = await self.bus.subscribe(budget_subject, on_budget_changed)
        batcher = Batcher(
            store=store,
            engine=engine,
            bus=self.bus,
            config=batcher_config,
            metrics=metrics,
            holder=f"gateway-{secrets.token_hex(4)}",
            lease_seconds=s.batcher_drain_lease_seconds,
        )
        drains = None if s.batcher_self_drain else ScheduledDrains(batcher, RpcClient(self.bus))
        self.api = GatewayApi(
            engine, batcher, budget_changed=budget_changed, section_added=drains.on_added if drains else None
        )
        self.rpc_server = RpcServer(self.bus, SERVICE, metrics=MessagingMetrics(self.registry))
        register_nats(self.rpc_server, self.api, model_pb2, "ModelGateway")
        await self.rpc_server.start()
        self.grpc = await start_grpc_server(
            [_stream_binding(self.api, grpc_binding(self.api, model_pb2, model_pb2_grpc, "ModelGateway"))],
            host=s.grpc_host,
            port=s.gateway_grpc_port,
            token=s.operator_token.get_secret_value(),
            default_timeout=max(60.0, s.provider_timeout_seconds * s.retry_attempts),
        )
        if drains is not None:
            self.drain_workers = WorkerHost(
                self.bus, service=SERVICE, workers=drains.workers(), registry=self.registry
            )
            await self.drain_workers.start()
        else:
            self.timer = DrainTimer(batcher, s.batcher_tick_ms / 1000)
            self.timer.start()
        self.metrics_server = serve(
            self.registry, s.metrics_host, s.gateway_metrics_port, port_setting="PARLEY_GATEWAY_METRICS_PORT"
        )
        log.info(
            "model gateway ready",
            grpc_port=self.grpc.port,
            metrics_port=self.metrics_server.port,
            providers=",".join(sorted({f"{t}={p.name}" for t, p in routes.items()})),
            embeddings=f"{embedder.name}/{embedder.model}/{embedder.dimension}",
        )

    async def stop(self) -> None:
        steps: list[tuple[str, Callable[[], Awaitable[object]]]] = []
        if self.timer:
            steps.append(("drain timer", self.timer.stop))
        if self.drain_workers:
            steps.append(("drain worker", partial(self.drain_workers.stop, 5)))
        if self.rpc_server:
            steps.append(("rpc", partial(self.rpc_server.stop, 5)))
        if self.grpc:
            steps.append(("grpc", partial(self.grpc.stop, 2)))
        if self.ledger:
            steps.append(("usage ledger", self.ledger.stop))
        if self.bus:
            steps.append(("nats", self.bus.close))
        for provider in self.providers:
            steps.append((f"provider {provider.name}", provider.close))
        if self.embedder:
            steps.append(("embedder", self.embedder.close))
        if self.db:
            steps.append(("database", self.db.close))
        await shutdown_in_order(steps, timeout=self.settings.shutdown_timeout_seconds)
        if self.metrics_server:
            self.metrics_server.stop()
