"""Wiring of the model gateway."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from functools import partial

from prometheus_client import CollectorRegistry

from parley.v1 import model_pb2, model_pb2_grpc
from parley_platform.bus import Bus
from parley_platform.errors import InvalidArgument
from parley_platform.grpcserver import GrpcServer, start_grpc_server
from parley_platform.lifecycle import shutdown_in_order
from parley_platform.logging import get_logger
from parley_platform.metrics import MessagingMetrics, MetricsServer, serve
from parley_platform.rpc import RpcServer
from parley_platform.service import grpc_binding, register_nats

from .api import MODEL_TYPES, GatewayApi, GatewayMetrics
from .config import GatewaySettings
from .provider import Provider
from .scripted import HashingEmbedder, ScriptedProvider, load_rules

log = get_logger(__name__)

SERVICE = "model"


def build_providers(settings: GatewaySettings) -> dict[str, Provider]:
    rules = load_rules(settings.scripted_rules) if settings.scripted_rules else []
    scripted = ScriptedProvider(rules=rules, latency_ms=settings.scripted_latency_ms)
    return {model_type: scripted for model_type in MODEL_TYPES.values()}


class GatewayApp:
    def __init__(self, settings: GatewaySettings) -> None:
        self.settings = settings
        self.registry = CollectorRegistry()
        self.grpc: GrpcServer | None = None
        self.metrics_server: MetricsServer | None = None
        self.bus: Bus | None = None
        self.rpc_server: RpcServer | None = None

    async def start(self) -> None:
        s = self.settings
        if s.operator_token is None:
            raise InvalidArgument(
                "PARLEY_OPERATOR_TOKEN is not set",
                code="OPERATOR_TOKEN_REQUIRED",
                hint="`parley run` sets one for you; otherwise choose a long random string",
            )
        self.api = GatewayApi(build_providers(s), HashingEmbedder(), GatewayMetrics(self.registry))
        self.bus = await Bus.connect(s.nats_url, name="model-gateway", namespace=s.namespace)
        self.rpc_server = RpcServer(self.bus, SERVICE, metrics=MessagingMetrics(self.registry))
        register_nats(self.rpc_server, self.api, model_pb2, "ModelGateway")
        await self.rpc_server.start()
        self.grpc = await start_grpc_server(
            [grpc_binding(self.api, model_pb2, model_pb2_grpc, "ModelGateway")],
            host=s.grpc_host,
            port=s.gateway_grpc_port,
            token=s.operator_token.get_secret_value(),
        )
        self.metrics_server = serve(
            self.registry, s.metrics_host, s.gateway_metrics_port, port_setting="PARLEY_GATEWAY_METRICS_PORT"
        )
        log.info(
            "model gateway ready",
            grpc_port=self.grpc.port,
            metrics_port=self.metrics_server.port,
            provider=s.model_provider,
        )

    async def stop(self) -> None:
        steps: list[tuple[str, Callable[[], Awaitable[object]]]] = []
        if self.rpc_server:
            steps.append(("rpc", partial(self.rpc_server.stop, 5)))
        if self.grpc:
            steps.append(("grpc", partial(self.grpc.stop, 2)))
        if self.bus:
            steps.append(("nats", self.bus.close))
        await shutdown_in_order(steps, timeout=self.settings.shutdown_timeout_seconds)
        if self.metrics_server:
            self.metrics_server.stop()
