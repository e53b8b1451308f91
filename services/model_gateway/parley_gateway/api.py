"""The ``parley.v1.ModelGateway`` service."""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from parley.v1 import model_pb2
from parley_platform.errors import FailedPrecondition, InvalidArgument
from parley_platform.metrics import LATENCY_BUCKETS

from .provider import Embedder, Provider, ProviderRequest

MODEL_TYPES = {
    value: name.removeprefix("MODEL_TYPE_") for name, value in model_pb2.ModelType.items() if value
}
MAX_PROMPT_CHARS = 4 * 1024 * 1024


class GatewayMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter(
            "parley_model_requests_total",
            "Model requests",
            ["provider", "model_type", "outcome"],
            registry=registry,
        )
        self.duration = Histogram(
            "parley_model_request_duration_seconds",
            "Model request time",
            ["provider", "model_type"],
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.tokens = Counter("parley_model_tokens_total", "Tokens", ["provider", "kind"], registry=registry)
        self.inflight = Gauge("parley_model_inflight", "Requests in flight", ["provider"], registry=registry)


def validate_generate(request: model_pb2.GenerateRequest) -> str:
    """Checks a request; returns its model type name."""
    model_type = MODEL_TYPES.get(request.model_type)
    if model_type is None:
        raise InvalidArgument(
            "model_type must be one of " + ", ".join(MODEL_TYPES.values()), code="UNKNOWN_MODEL_TYPE"
        )
    if not request.prompt and not request.segments:
        raise InvalidArgument("prompt or segments is required", code="PROMPT_REQUIRED")
    if len(request.prompt) > MAX_PROMPT_CHARS:
        raise InvalidArgument(f"prompt is over {MAX_PROMPT_CHARS} characters", code="PROMPT_TOO_LARGE")
    if request.segments and request.prompt != "".join(s.content for s in request.segments):
        raise InvalidArgument(
            "prompt must equal the concatenation of the segments' content",
            code="PROMPT_SEGMENTS_MISMATCH",
            hint="build the prompt as ''.join(segment.content for segment in segments)",
        )
    if request.max_tokens < 0:
        raise InvalidArgument("max_tokens must be 0 (provider default) or more", code="INVALID_MAX_TOKENS")
    if request.HasField("temperature") and not 0 <= request.temperature <= 2:
        raise InvalidArgument("temperature must be from 0 to 2", code="INVALID_TEMPERATURE")
    return model_type


MAX_EMBED_TEXTS = 256
MAX_EMBED_CHARS = 32_000


class GatewayApi:
    def __init__(self, providers: dict[str, Provider], embedder: Embedder, metrics: GatewayMetrics) -> None:
        self.providers = providers
        self.embedder = embedder
        self.metrics = metrics

    async def Embed(self, request: model_pb2.EmbedRequest) -> model_pb2.EmbedResponse:
        texts = list(request.texts)
        if not texts:
            raise InvalidArgument("texts must not be empty", code="TEXTS_REQUIRED")
        if len(texts) > MAX_EMBED_TEXTS:
            raise InvalidArgument(f"at most {MAX_EMBED_TEXTS} texts per call", code="TOO_MANY_TEXTS")
        too_long = next((i for i, t in enumerate(texts) if len(t) > MAX_EMBED_CHARS), None)
        if too_long is not None:
            raise InvalidArgument(
                f"texts[{too_long}] is over {MAX_EMBED_CHARS} characters", code="TEXT_TOO_LONG"
            )
        started = time.perf_counter()
        result = await self.embedder.embed(texts)
        self.metrics.requests.labels(self.embedder.name, "EMBEDDING", "ok").inc()
        self.metrics.duration.labels(self.embedder.name, "EMBEDDING").observe(time.perf_counter() - started)
        self.metrics.tokens.labels(self.embedder.name, "input").inc(result.input_tokens)
        return model_pb2.EmbedResponse(
            embeddings=[model_pb2.Embedding(values=v) for v in result.vectors],
            dimension=result.dimension,
            model=result.model,
            usage=model_pb2.Usage(input_tokens=result.input_tokens),
        )

    async def Generate(self, request: model_pb2.GenerateRequest) -> model_pb2.GenerateResponse:
        model_type = validate_generate(request)
        provider = self.providers.get(model_type)
        if provider is None:
            raise FailedPrecondition(
                f"no provider configured for {model_type}",
                code="NO_PROVIDER",
                hint="set PARLEY_MODEL_PROVIDER",
            )
        prompt = request.prompt or "".join(s.content for s in request.segments)
        started = time.perf_counter()
        outcome = "error"
        self.metrics.inflight.labels(provider.name).inc()
        try:
            completion = await provider.generate(
                ProviderRequest(
                    model_type=model_type,
                    prompt=prompt,
                    system=request.system,
                    segments=[(s.content, s.stable) for s in request.segments],
                    temperature=request.temperature if request.HasField("temperature") else None,
                    max_tokens=request.max_tokens,
                    stop=list(request.stop_sequences),
                    grammar=request.response_grammar,
                )
            )
            outcome = "ok"
        finally:
            elapsed = time.perf_counter() - started
            self.metrics.inflight.labels(provider.name).dec()
            self.metrics.requests.labels(provider.name, model_type, outcome).inc()
            self.metrics.duration.labels(provider.name, model_type).observe(elapsed)
        self.metrics.tokens.labels(provider.name, "input").inc(completion.input_tokens)
        self.metrics.tokens.labels(provider.name, "output").inc(completion.output_tokens)
        self.metrics.tokens.labels(provider.name, "cached").inc(completion.cached_input_tokens)
        return model_pb2.GenerateResponse(
            text=completion.text,
            provider=provider.name,
            model=provider.model,
            usage=model_pb2.Usage(
                input_tokens=completion.input_tokens,
                output_tokens=completion.output_tokens,
                cached_input_tokens=completion.cached_input_tokens,
            ),
            finish_reason=completion.finish_reason,
            latency_seconds=elapsed,
        )
