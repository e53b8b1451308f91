"""The ``parley.v1.ModelGateway`` service: protobuf in and out, validated here, everything else
in the engine and the batcher. Served over gRPC (operators) and NATS (services)."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator, Awaitable, Callable

from parley.v1 import model_pb2
from parley_platform.convert import timestamp
from parley_platform.paging import cut, page_of

from . import errors
from .batcher import Batcher, drain_interval_ms
from .batching import AFFINITY, SchemaField, Section, validate_section
from .engine import Call, Engine, Result
from .provider import Chunk, ProviderRequest, Segment
from .records import Budget, UsageTotal

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


def validate_agent(agent_id: str, *, required: bool) -> str:
    if not agent_id:
        if required:
            raise errors.AGENT_REQUIRED("agent_id is required")
        return ""
    if not AGENT_ID.fullmatch(agent_id):
        raise errors.INVALID_AGENT_ID("agent_id must be 1-128 letters, digits, '-' or '_'")
    return agent_id


def to_call(request: model_pb2.GenerateRequest, kind: str) -> Call:
    """The request checked and as the engine takes it. Each field is read from the message once: a
    string field is decoded again on every read, and a prompt may be megabytes."""
    agent_id = validate_agent(request.agent_id, required=False)
    model_type = MODEL_TYPES.get(request.model_type)
    if model_type is None:
        raise errors.UNKNOWN_MODEL_TYPE("model_type must be one of " + ", ".join(MODEL_TYPES.values()))
    prompt, segments = request.prompt, request.segments
    parts: tuple[Segment, ...] = ()
    if segments:
        # The segments are the prompt; a caller need not send it twice.
        parts = tuple(Segment(s.content, s.stable) for s in segments)
        joined = "".join(s.content for s in parts)
        if prompt and prompt != joined:
            raise errors.PROMPT_SEGMENTS_MISMATCH(
                "prompt, when given with segments, must equal the concatenation of their content"
            )
        prompt = joined
    if not prompt:
        raise errors.PROMPT_REQUIRED("prompt or segments is required")
    if len(prompt) > MAX_PROMPT_CHARS:
        raise errors.PROMPT_TOO_LARGE(f"prompt is over {MAX_PROMPT_CHARS} characters")
    max_tokens = request.max_tokens
    if max_tokens < 0:
        raise errors.INVALID_MAX_TOKENS("max_tokens must be 0 (provider default) or more")
    temperature = request.temperature if request.HasField("temperature") else None
    if temperature is not None and not 0 <= temperature <= 2:
        raise errors.INVALID_TEMPERATURE("temperature must be from 0 to 2")
    system = request.system
    if len(system) > MAX_PROMPT_CHARS:
        raise errors.PROMPT_TOO_LARGE(f"system is over {MAX_PROMPT_CHARS} characters")
    stop = tuple(request.stop_sequences)
    if len(stop) > 16 or any(not s or len(s) > 256 for s in stop):
        raise errors.INVALID_STOP(
            "stop_sequences must be at most 16 non-empty strings of up to 256 characters"
        )
    grammar = request.response_grammar
    if len(grammar) > 64 * 1024:
        raise errors.INVALID_GRAMMAR("response_grammar is over 65536 characters")
    return Call(
        agent_id=agent_id,
        kind=kind,
        request=ProviderRequest(
            model_type=model_type,
            prompt=prompt,
            system=system,
            segments=parts,
            temperature=temperature,
            max_tokens=max_tokens,
            stop=stop,
            grammar=grammar,
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
        raise errors.INVALID_SECTION("section.model_type is not a known model type")
    priority = PRIORITIES.get(proto.priority)
    if priority is None:
        raise errors.INVALID_SECTION("section.priority is not a known priority")
    frequency = FREQUENCIES.get(proto.frequency)
    if frequency is None:
        raise errors.INVALID_SECTION("section.frequency is not a known frequency")
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


def _budget(budget: Budget | None, agent_id: str) -> model_pb2.Budget:
    if budget is None:
        return model_pb2.Budget(agent_id=agent_id)
    return model_pb2.Budget(
        agent_id=budget.agent_id,
        limit_tokens=budget.limit_tokens,
        window_seconds=budget.window_seconds,
        spent_tokens=budget.spent_tokens,
        reserved_tokens=budget.reserved_tokens,
        window_started_at=timestamp(budget.window_started_at),
    )


def _usage_row(usage: UsageTotal) -> model_pb2.UsageRow:
    return model_pb2.UsageRow(
        agent_id=usage.agent_id,
        provider=usage.provider,
        model=usage.model,
        model_type=MODEL_TYPE_VALUES.get(usage.model_type, 0),  # type: ignore[arg-type]
        kind=usage.kind,
        requests=usage.requests,
        usage=model_pb2.Usage(
            input_tokens=usage.input_tokens,
            output_tokens=usage.output_tokens,
            cached_input_tokens=usage.cached_input_tokens,
        ),
        first_at=timestamp(usage.first_at),
        last_at=timestamp(usage.last_at),
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
            raise errors.TEXTS_REQUIRED("texts needs at least one text")
        if len(request.texts) > MAX_EMBED_TEXTS:
            raise errors.TOO_MANY_TEXTS(f"texts has more than {MAX_EMBED_TEXTS} entries")
        for index, text in enumerate(request.texts):
            if len(text) > MAX_EMBED_CHARS:
                raise errors.TEXT_TOO_LARGE(f"texts[{index}] is over {MAX_EMBED_CHARS} characters")
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
            raise errors.INVALID_BUDGET("limit_tokens must be 0 (no budget) or more")
        store = self.engine.budgets.store
        if request.limit_tokens == 0:
            await store.delete_budget(agent_id)
            await self.budget_changed(agent_id)
            return model_pb2.Budget(agent_id=agent_id)
        window = request.window_seconds or self.engine.budgets.window_seconds
        if not 1 <= window <= 31 * 86400:
            raise errors.INVALID_BUDGET("window_seconds must be from 1 to 2678400")
        budget = await store.set_budget(agent_id, request.limit_tokens, window)
        await self.budget_changed(agent_id)
        return _budget(budget, agent_id)

    async def GetBudget(self, request: model_pb2.GetBudgetRequest) -> model_pb2.Budget:
        agent_id = validate_agent(request.agent_id, required=True)
        return _budget(await self.engine.budgets.store.get_budget(agent_id), agent_id)

    async def GetUsage(self, request: model_pb2.GetUsageRequest) -> model_pb2.GetUsageResponse:
        agent_id = validate_agent(request.agent_id, required=False)
        page = page_of(request.page if request.HasField("page") else None)
        # What this replica has not written yet belongs in the answer too.
        await self.engine.ledger.flush()
        totals = await self.engine.budgets.store.list_usage(agent_id, page.fetch, page.offset)
        shown, page_response = cut(page, totals)
        return model_pb2.GetUsageResponse(rows=[_usage_row(t) for t in shown], page=page_response)

    async def AddSection(self, request: model_pb2.AddSectionRequest) -> model_pb2.AddSectionResponse:
        if not request.HasField("section"):
            raise errors.INVALID_SECTION("section is required")
        section = to_section(request.section)
        registered = await self.batcher.add(section)
        if registered and self.section_added is not None:
            await self.section_added(section)
        return model_pb2.AddSectionResponse(registered=registered, already_registered=not registered)

    async def Drain(self, request: model_pb2.DrainRequest) -> model_pb2.DrainResponse:
        affinity = request.affinity or "default"
        if not AFFINITY.fullmatch(affinity):
            raise errors.INVALID_AFFINITY("affinity must be default, autonomy, init or room:<id>")
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
            raise errors.INVALID_AFFINITY("affinity must be default, autonomy, init or room:<id>")
        config = self.batcher.config
        statuses = await self.batcher.store.batcher_status(request.affinity)
        return model_pb2.BatcherStatusResponse(
            affinities=[
                model_pb2.AffinityStatus(
                    affinity=status.affinity,
                    pending=status.pending,
                    sections=status.sections,
                    drains=status.drains,
                    draining=status.draining,
                    last_drain_at=timestamp(status.last_drain_at),
                    drain_interval_ms=drain_interval_ms(config, status.min_cycle_ms),
                )
                for status in statuses
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
            raise errors.INVALID_DISPOSE("name section_ids or an owner to dispose")
        disposed = await self.batcher.store.dispose_sections(
            agent_id, list(request.section_ids), request.owner
        )
        return model_pb2.DisposeSectionsResponse(disposed=disposed)
