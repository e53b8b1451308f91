"""The ``parley.v1.ModelGateway`` service: protobuf in and out, validated here, everything else
in the engine and the batcher. Served over gRPC (operators) and NATS (services)."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import datetime

from google.protobuf.timestamp_pb2 import Timestamp

from parley.v1 import model_pb2
from parley_platform.errors import InvalidArgument
from parley_platform.paging import cut, page_of

from .batcher import Batcher, drain_interval_ms
from .batching import AFFINITY, SchemaField, Section, validate_section
from .engine import Call, Engine, Result
from .provider import Chunk, ProviderRequest, Segment

MODEL_TYPES = {
    value: name.removeprefix("MODEL_TYPE_") for name, value in model_pb2.ModelType.items() if value
}
MODEL_TYPE_VALUES = {name: value for value, name in MODEL_TYPES.items()}
PRIORITIES = {
    model_pb2.SECTION_PRIORITY_UNSPECIFIED: "normal",
    model_pb2.SECTION_PRIORITY_IMMEDIATE: "immediate",
    model_pb2.SECTION_PRIORITY_NORMAL: "normal",
    model_pb2.SECTION_PRIORITY_BACKGROUND: "background",
}
FREQUENCIES = {
    model_pb2.SECTION_FREQUENCY_UNSPECIFIED: "once",
    model_pb2.SECTION_FREQUENCY_ONCE: "once",
    model_pb2.SECTION_FREQUENCY_PER_DRAIN: "per_drain",
    model_pb2.SECTION_FREQUENCY_RECURRING: "recurring",
}
MAX_PROMPT_CHARS = 4 * 1024 * 1024
MAX_EMBED_TEXTS = 256
MAX_EMBED_CHARS = 64 * 1024
AGENT_ID = re.compile(r"[A-Za-z0-9_-]{1,128}", re.ASCII)


def _ts(value: datetime | None) -> Timestamp | None:
    if value is None:
        return None
    ts = Timestamp()
    ts.FromDatetime(value)
    return ts


def validate_agent(agent_id: str, *, required: bool) -> str:
    if not agent_id:
        if required:
            raise InvalidArgument("agent_id is required", code="AGENT_REQUIRED")
        return ""
    if not AGENT_ID.fullmatch(agent_id):
        raise InvalidArgument("agent_id must be 1-128 letters, digits, '-' or '_'", code="INVALID_AGENT_ID")
    return agent_id


def validate_generate(request: model_pb2.GenerateRequest) -> str:
    """Checks a request; returns its model type name."""
    validate_agent(request.agent_id, required=False)
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
    if len(request.system) > MAX_PROMPT_CHARS:
        raise InvalidArgument(f"system is over {MAX_PROMPT_CHARS} characters", code="PROMPT_TOO_LARGE")
    if len(request.stop_sequences) > 16 or any(not s or len(s) > 256 for s in request.stop_sequences):
        raise InvalidArgument(
            "stop_sequences must be at most 16 non-empty strings of up to 256 characters", code="INVALID_STOP"
        )
    if len(request.response_grammar) > 64 * 1024:
        raise InvalidArgument("response_grammar is over 65536 characters", code="INVALID_GRAMMAR")
    return model_type


def to_call(request: model_pb2.GenerateRequest, kind: str) -> Call:
    model_type = validate_generate(request)
    prompt = request.prompt or "".join(s.content for s in request.segments)
    return Call(
        agent_id=request.agent_id,
        kind=kind,
        request=ProviderRequest(
            model_type=model_type,
            prompt=prompt,
            system=request.system,
            segments=tuple(Segment(s.content, s.stable) for s in request.segments),
            temperature=request.temperature if request.HasField("temperature") else None,
            max_tokens=request.max_tokens,
            stop=tuple(request.stop_sequences),
            grammar=request.response_grammar,
        ),
    )


def to_response(result: Result) -> model_pb2.GenerateResponse:
    c = result.completion
    return model_pb2.GenerateResponse(
        text=c.text,
        provider=result.provider,
        model=result.model,
        usage=model_pb2.Usage(
            input_tokens=c.input_tokens,
            output_tokens=c.output_tokens,
            cached_input_tokens=c.cached_input_tokens,
        ),
        finish_reason=c.finish_reason,
        latency_seconds=result.latency,
    )


def to_section(proto: model_pb2.Section) -> Section:
    validate_agent(proto.agent_id, required=True)
    tier = MODEL_TYPES.get(proto.model_type or model_pb2.MODEL_TYPE_TEXT_SMALL)
    if tier is None:
        raise InvalidArgument("section.model_type is not a known model type", code="INVALID_SECTION")
    priority = PRIORITIES.get(proto.priority)
    if priority is None:
        raise InvalidArgument("section.priority is not a known priority", code="INVALID_SECTION")
    frequency = FREQUENCIES.get(proto.frequency)
    if frequency is None:
        raise InvalidArgument("section.frequency is not a known frequency", code="INVALID_SECTION")
    return validate_section(
        Section(
            id=proto.id,
            agent_id=proto.agent_id,
            affinity=proto.affinity or "default",
            prompt=proto.prompt,
            fields=tuple(
                SchemaField(name=f.name, description=f.description, optional=f.optional, pattern=f.pattern)
                for f in proto.fields
            ),
            priority=priority,
            tier=tier,
            isolated=proto.isolated,
            fallback=dict(proto.fallback),
            frequency=frequency,
            min_cycle_ms=proto.min_cycle_ms,
            max_retries=proto.max_retries,
            owner=proto.owner,
            system=proto.system,
        )
    )


def _budget(row: dict[str, object] | None, agent_id: str) -> model_pb2.Budget:
    if row is None:
        return model_pb2.Budget(agent_id=agent_id)
    return model_pb2.Budget(
        agent_id=str(row["agent_id"]),
        limit_tokens=int(row["limit_tokens"]),  # type: ignore[call-overload]
        window_seconds=int(row["window_seconds"]),  # type: ignore[call-overload]
        spent_tokens=int(row["spent_tokens"]),  # type: ignore[call-overload]
        reserved_tokens=int(row["reserved_tokens"]),  # type: ignore[call-overload]
        window_started_at=_ts(row["window_started_at"]),  # type: ignore[arg-type]
    )


class GatewayApi:
    def __init__(
        self,
        engine: Engine,
        batcher: Batcher,
        *,
        budget_changed: Callable[[str], Awaitable[None]],
        section_added: Callable[[Section], Awaitable[None]] | None = None,
    ) -> None:
        self.engine = engine
        self.batcher = batcher
        self.budget_changed = budget_changed
        self.section_added = section_added

    async def Generate(self, request: model_pb2.GenerateRequest) -> model_pb2.GenerateResponse:
        return to_response(await self.engine.generate(to_call(request, "generate")))

    async def GenerateStream(
        self, request: model_pb2.GenerateRequest
    ) -> AsyncIterator[model_pb2.GenerateChunk]:
        call = to_call(request, "stream")
        async for item in self.engine.stream(call):
            if isinstance(item, Chunk):
                yield model_pb2.GenerateChunk(text=item.text)
            else:
                yield model_pb2.GenerateChunk(done=True, response=to_response(item))

    async def Embed(self, request: model_pb2.EmbedRequest) -> model_pb2.EmbedResponse:
        validate_agent(request.agent_id, required=False)
        if not request.texts:
            raise InvalidArgument("texts needs at least one text", code="TEXTS_REQUIRED")
        if len(request.texts) > MAX_EMBED_TEXTS:
            raise InvalidArgument(f"texts has more than {MAX_EMBED_TEXTS} entries", code="TOO_MANY_TEXTS")
        for index, text in enumerate(request.texts):
            if len(text) > MAX_EMBED_CHARS:
                raise InvalidArgument(
                    f"texts[{index}] is over {MAX_EMBED_CHARS} characters", code="TEXT_TOO_LARGE"
                )
        result = await self.engine.embed(request.agent_id, list(request.texts))
        return model_pb2.EmbedResponse(
            embeddings=[model_pb2.Embedding(values=v) for v in result.vectors],
            dimension=result.dimension,
            model=result.model,
            usage=model_pb2.Usage(input_tokens=result.input_tokens),
        )

    async def ListModels(self, request: model_pb2.ListModelsRequest) -> model_pb2.ListModelsResponse:
        routes = [
            model_pb2.ModelRoute(
                model_type=MODEL_TYPE_VALUES[model_type],
                provider=p.provider.name,
                model=p.provider.model_for(model_type),
            )
            for model_type, p in sorted(self.engine.routes.items())
        ]
        providers = [
            model_pb2.ProviderStatus(
                name=p.provider.name,
                model=", ".join(
                    sorted({p.provider.model_for(t) for t, q in self.engine.routes.items() if q is p})
                ),
                healthy=p.breaker.state != "open",
                circuit=p.breaker.state,
                inflight=p.limiter.inflight,
                queued=p.limiter.queued,
                concurrency_limit=p.limiter.limit,
                queue_limit=p.limiter.queue_limit,
            )
            for p in self.engine.providers()
        ]
        embedder = self.engine.embedder
        return model_pb2.ListModelsResponse(
            routes=routes,
            providers=providers,
            embedding_provider=embedder.name,
            embedding_model=embedder.model,
            embedding_dimension=embedder.dimension,
        )

    async def SetBudget(self, request: model_pb2.SetBudgetRequest) -> model_pb2.Budget:
        agent_id = validate_agent(request.agent_id, required=True)
        if request.limit_tokens < 0:
            raise InvalidArgument("limit_tokens must be 0 (no budget) or more", code="INVALID_BUDGET")
        store = self.engine.budgets.store
        if request.limit_tokens == 0:
            await store.delete_budget(agent_id)
            await self.budget_changed(agent_id)
            return model_pb2.Budget(agent_id=agent_id)
        window = request.window_seconds or self.engine.budgets.window_seconds
        if not 1 <= window <= 31 * 86400:
            raise InvalidArgument("window_seconds must be from 1 to 2678400", code="INVALID_BUDGET")
        row = await store.set_budget(agent_id, request.limit_tokens, window)
        await self.budget_changed(agent_id)
        return _budget(row, agent_id)

    async def GetBudget(self, request: model_pb2.GetBudgetRequest) -> model_pb2.Budget:
        agent_id = validate_agent(request.agent_id, required=True)
        return _budget(await self.engine.budgets.store.get_budget(agent_id), agent_id)

    async def GetUsage(self, request: model_pb2.GetUsageRequest) -> model_pb2.GetUsageResponse:
        agent_id = validate_agent(request.agent_id, required=False)
        page = page_of(request.page if request.HasField("page") else None)
        # What this replica has not written yet belongs in the answer too.
        await self.engine.ledger.flush()
        rows = await self.engine.budgets.store.list_usage(agent_id, page.fetch, page.offset)
        shown, page_response = cut(page, rows)
        return model_pb2.GetUsageResponse(
            rows=[
                model_pb2.UsageRow(
                    agent_id=r["agent_id"],
                    provider=r["provider"],
                    model=r["model"],
                    model_type=MODEL_TYPE_VALUES.get(r["model_type"], 0),  # type: ignore[arg-type]
                    kind=r["kind"],
                    requests=r["requests"],
                    usage=model_pb2.Usage(
                        input_tokens=r["input_tokens"],
                        output_tokens=r["output_tokens"],
                        cached_input_tokens=r["cached_input_tokens"],
                    ),
                    first_at=_ts(r["first_at"]),
                    last_at=_ts(r["last_at"]),
                )
                for r in shown
            ],
            page=page_response,
        )

    async def AddSection(self, request: model_pb2.AddSectionRequest) -> model_pb2.AddSectionResponse:
        if not request.HasField("section"):
            raise InvalidArgument("section is required", code="INVALID_SECTION")
        section = to_section(request.section)
        registered = await self.batcher.add(section)
        if registered and self.section_added is not None:
            await self.section_added(section)
        return model_pb2.AddSectionResponse(registered=registered, already_registered=not registered)

    async def Drain(self, request: model_pb2.DrainRequest) -> model_pb2.DrainResponse:
        affinity = request.affinity or "default"
        if not AFFINITY.fullmatch(affinity):
            raise InvalidArgument(
                "affinity must be default, autonomy, init or room:<id>", code="INVALID_AFFINITY"
            )
        drained = await self.batcher.drain(affinity)
        return model_pb2.DrainResponse(
            affinity=affinity,
            drain_seq=drained.seq,
            sections=drained.sections,
            calls=drained.calls,
            results=drained.results,
        )

    async def BatcherStatus(self, request: model_pb2.BatcherStatusRequest) -> model_pb2.BatcherStatusResponse:
        if request.affinity and not AFFINITY.fullmatch(request.affinity):
            raise InvalidArgument(
                "affinity must be default, autonomy, init or room:<id>", code="INVALID_AFFINITY"
            )
        config = self.batcher.config
        rows = await self.batcher.store.batcher_status(request.affinity)
        return model_pb2.BatcherStatusResponse(
            affinities=[
                model_pb2.AffinityStatus(
                    affinity=r["affinity"],
                    pending=r["pending"],
                    sections=r["sections"],
                    drains=r["drains"],
                    draining=bool(r["draining"]),
                    last_drain_at=_ts(r["last_drain_at"]),
                    drain_interval_ms=drain_interval_ms(config, r["min_cycle_ms"]),
                )
                for r in rows
            ],
            config=model_pb2.BatcherConfig(
                batch_size=config.batch_size,
                max_drain_interval_ms=config.max_drain_interval_ms,
                max_sections_per_call=config.max_sections_per_call,
                packing_density=config.packing_density,
                max_tokens_per_call=config.max_tokens_per_call,
                max_parallel_calls=config.max_parallel_calls,
                model_separation=config.model_separation,
            ),
        )

    async def DisposeSections(
        self, request: model_pb2.DisposeSectionsRequest
    ) -> model_pb2.DisposeSectionsResponse:
        agent_id = validate_agent(request.agent_id, required=True)
        if not request.section_ids and not request.owner:
            raise InvalidArgument("name section_ids or an owner to dispose", code="INVALID_DISPOSE")
        disposed = await self.batcher.store.dispose_sections(
            agent_id, list(request.section_ids), request.owner
        )
        return model_pb2.DisposeSectionsResponse(disposed=disposed)
