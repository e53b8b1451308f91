"""Every model call goes through here, whatever its provider and whoever asked (API or batcher):
route by model type → reserve the agent's budget → wait for a provider slot → breaker → call,
retrying retryable failures with backoff → commit usage to the budget and the ledger → metrics."""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from parley_platform.errors import ParleyError
from parley_platform.logging import get_logger
from parley_platform.metrics import (
    LATENCY_BUCKETS,
    GaugeFunctions,
    LoopCount,
    LoopCounter,
    LoopHistogram,
    LoopTiming,
)

from . import errors
from .protection import CircuitBreaker, Limiter, RetryPolicy, counts_against_provider, with_retries
from .provider import Chunk, Completion, Embedder, Embeddings, Provider, ProviderRequest, estimate_tokens
from .records import UsageIncrement
from .store import GatewayStore

log = get_logger(__name__)

MODEL_BUCKETS = (*LATENCY_BUCKETS, 60, 120)


class GatewayMetrics:
    """The gateway's metrics. What every call updates is kept in loop-owned counters
    (``parley_platform.metrics.LoopCounter``): prometheus_client's locked children cost a fifth of
    a call's handling."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = LoopCounter(
            "parley_model_requests_total",
            "Model requests",
            ["provider", "model_type", "outcome"],
            registry,
        )
        self.duration = LoopHistogram(
            "parley_model_request_duration_seconds",
            "Model request time",
            ["provider", "model_type"],
            registry,
            buckets=MODEL_BUCKETS,
        )
        self.tokens = LoopCounter("parley_model_tokens_total", "Tokens", ["provider", "kind"], registry)
        self.budget_rejections = Counter(
            "parley_model_budget_rejections_total",
            "Calls refused for an agent's token budget",
            registry=registry,
        )
        self.retries = Counter(
            "parley_model_retries_total", "Provider calls retried", ["provider", "code"], registry=registry
        )
        self.batcher_sections = Gauge(
            "parley_batcher_sections", "Sections waiting for a drain", ["affinity"], registry=registry
        )
        self.batcher_calls = Counter(
            "parley_batcher_calls_total", "Model calls made by drains", registry=registry
        )
        self.batcher_sections_per_call = Histogram(
            "parley_batcher_sections_per_call",
            "Sections packed into one call",
            buckets=(1, 2, 3, 4, 6, 8, 12, 16, 24, 32),
            registry=registry,
        )
        self._series: dict[tuple[str, str], Series] = {}
        self._protected: Callable[[], Sequence[Protected]] = tuple
        # The calls holding a slot of each provider's limiter, read when scraped (no update per call).
        GaugeFunctions(
            "parley_model_inflight",
            "Requests in flight",
            ["provider"],
            lambda: {(p.provider.name,): float(p.limiter.inflight) for p in self._protected()},
            registry,
        )

    def watch_inflight(self, protected: Callable[[], Sequence[Protected]]) -> None:
        """``parley_model_inflight`` counts the calls of these providers."""
        self._protected = protected

    def of(self, provider: str, model_type: str) -> Series:
        """The series of one provider and model type, looked up once."""
        found = self._series.get((provider, model_type))
        if found is None:
            found = Series(
                ok=self.requests.labels(provider, model_type, "ok"),
                duration=self.duration.labels(provider, model_type),
                input=self.tokens.labels(provider, "input"),
                output=self.tokens.labels(provider, "output"),
                cached=self.tokens.labels(provider, "cached"),
            )
            self._series[(provider, model_type)] = found
        return found


@dataclass(frozen=True, slots=True)
class Series:
    ok: LoopCount
    duration: LoopTiming
    input: LoopCount
    output: LoopCount
    cached: LoopCount


@dataclass
class Protected:
    provider: Provider
    limiter: Limiter
    breaker: CircuitBreaker


class Ledger:
    """Usage totals, added up in memory and written in one statement per flush."""

    def __init__(self, store: GatewayStore, flush_seconds: float) -> None:
        self.store = store
        self.flush_seconds = flush_seconds
        self._pending: dict[tuple[str, str, str, str, str], list[int]] = {}
        self._task: asyncio.Task[None] | None = None
        # One flush at a time: a reader that flushes first (GetUsage) must also wait for the rows
        # a flush already under way is writing.
        self._flushing = asyncio.Lock()

    def add(
        self, agent_id: str, provider: str, model: str, model_type: str, kind: str, c: Completion
    ) -> None:
        key = (agent_id, provider, model, model_type, kind)
        totals = self._pending.setdefault(key, [0, 0, 0, 0])
        totals[0] += 1
        totals[1] += c.input_tokens
        totals[2] += c.output_tokens
        totals[3] += c.cached_input_tokens

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop())

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.flush_seconds)
            try:
                await self.flush()
            except ParleyError as exc:
                log.warning("usage ledger flush failed; kept for the next one", code=exc.code)

    async def flush(self) -> None:
        async with self._flushing:
            await self._flush()

    async def _flush(self) -> None:
        if not self._pending:
            return
        pending, self._pending = self._pending, {}
        rows = [UsageIncrement(*key, *totals) for key, totals in pending.items()]
        try:
            await self.store.record_usage(rows)
        except BaseException:
            # Not lost: merged back for the next flush.
            for key, totals in pending.items():
                merged = self._pending.setdefault(key, [0, 0, 0, 0])
                for i, value in enumerate(totals):
                    merged[i] += value
            raise

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self.flush()


@dataclass(frozen=True)
class Hold:
    agent_id: str
    tokens: int


class Budgets:
    """Per-agent token budgets in PostgreSQL; reserve, commit and release are one statement each."""

    def __init__(
        self, store: GatewayStore, *, default_tokens: int, window_seconds: int, cache_seconds: float
    ) -> None:
        self.store = store
        self.default_tokens = default_tokens
        self.window_seconds = window_seconds
        self.cache_seconds = cache_seconds
        self._unbudgeted: dict[str, float] = {}
        self._defaulted: set[str] = set()

    def forget(self, agent_id: str) -> None:
        self._unbudgeted.pop(agent_id, None)
        self._defaulted.discard(agent_id)

    def may_limit(self, agent_id: str) -> bool:
        """Whether a call of this agent needs a reservation: not without an agent, nor for one this
        replica learned has no budget (trusted for ``cache_seconds``). Checked before ``reserve``
        on the hot path, which then awaits nothing for most calls."""
        if not agent_id:
            return False
        known_free = self._unbudgeted.get(agent_id)
        return known_free is None or known_free <= time.monotonic()

    async def reserve(self, agent_id: str, tokens: int) -> Hold | None:
        if not self.may_limit(agent_id):
            return None
        if self.default_tokens and agent_id not in self._defaulted:
            await self.store.ensure_budget(agent_id, self.default_tokens, self.window_seconds)
            self._defaulted.add(agent_id)
        reservation = await self.store.reserve(agent_id, tokens)
        if not reservation.budgeted:
            if len(self._unbudgeted) > 100_000:
                self._unbudgeted.clear()
            self._unbudgeted[agent_id] = time.monotonic() + self.cache_seconds
            return None
        if not reservation.admitted:
            raise errors.BUDGET_EXCEEDED(
                f"agent {agent_id[:64]} is over its token budget of {reservation.limit_tokens} tokens"
                " per window"
                f" (this call needs up to {tokens})"
            )
        return Hold(agent_id, tokens)

    async def commit(self, hold: Hold | None, used: int) -> None:
        if hold is not None:
            await self.store.commit(hold.agent_id, hold.tokens, used)

    async def release(self, hold: Hold | None) -> None:
        if hold is not None:
            await self.store.release(hold.agent_id, hold.tokens)


@dataclass(slots=True)
class Call:
    """One generation as the engine sees it: who asks, for what, on which path."""

    agent_id: str
    request: ProviderRequest
    kind: str = "generate"  # generate, stream, batch


@dataclass(slots=True)
class Result:
    completion: Completion
    provider: str
    model: str
    latency: float


class Engine:
    def __init__(
        self,
        *,
        routes: dict[str, Protected],
        embedder: Embedder,
        budgets: Budgets,
        ledger: Ledger,
        metrics: GatewayMetrics,
        retry: RetryPolicy,
        provider_timeout: float,
        default_max_tokens: int,
    ) -> None:
        self.routes = routes
        self.embedder = embedder
        self.budgets = budgets
        self.ledger = ledger
        self.metrics = metrics
        self.retry = retry
        self.provider_timeout = provider_timeout
        self.default_max_tokens = default_max_tokens
        self._rng = random.Random()
        metrics.watch_inflight(self.providers)

    def route(self, model_type: str) -> Protected:
        protected = self.routes.get(model_type)
        if protected is None:
            raise errors.NO_PROVIDER(
                f"no provider configured for {model_type}",
                hint=f"set PARLEY_MODEL_PROVIDER or PARLEY_MODEL_PROVIDER_{model_type}",
            )
        return protected

    def providers(self) -> list[Protected]:
        return list({id(p.provider): p for p in self.routes.values()}.values())

    def _prepare(self, call: Call) -> tuple[int, int]:
        """The call's output budget, and the tokens to reserve for it."""
        output = call.request.max_tokens or self.default_max_tokens
        return output, call.request.estimated_input_tokens() + output

    def _count(
        self, protected: Protected, call: Call, model: str, completion: Completion, elapsed: float
    ) -> None:
        name = protected.provider.name
        model_type = call.request.model_type
        series = self.metrics.of(name, model_type)
        series.ok.inc()
        series.duration.observe(elapsed)
        series.input.inc(completion.input_tokens)
        series.output.inc(completion.output_tokens)
        series.cached.inc(completion.cached_input_tokens)
        self.ledger.add(call.agent_id, name, model, model_type, call.kind, completion)

    def _failed(self, provider: str, model_type: str, exc: BaseException) -> None:
        if errors.BUDGET_EXCEEDED.matches(exc):
            self.metrics.budget_rejections.inc()
        outcome = exc.code if isinstance(exc, ParleyError) else "CANCELLED"
        self.metrics.requests.labels(provider, model_type, outcome).inc()

    async def generate(self, call: Call) -> Result:
        protected = self.route(call.request.model_type)
        provider = protected.provider
        output, reserve = self._prepare(call)
        started = time.perf_counter()
        hold: Hold | None = None
        budgets = self.budgets
        try:
            if budgets.may_limit(call.agent_id):
                hold = await budgets.reserve(call.agent_id, reserve)
            limiter = protected.limiter

            async def attempt(remaining: float) -> Completion:
                if not limiter.try_acquire():
                    await limiter.acquire()
                try:
                    return await provider.generate(
                        call.request.bounded(max_tokens=output, timeout=min(remaining, self.provider_timeout))
                    )
                finally:
                    limiter.release()

            completion = await with_retries(
                attempt,
                policy=self.retry,
                deadline=time.monotonic() + self.provider_timeout * self.retry.attempts,
                breaker=protected.breaker,
                rng=self._rng,
                on_retry=lambda e: self.metrics.retries.labels(provider.name, e.code).inc(),
            )
        except BaseException as exc:
            self._failed(protected.provider.name, call.request.model_type, exc)
            with contextlib.suppress(ParleyError):
                await asyncio.shield(self.budgets.release(hold))
            raise
        elapsed = time.perf_counter() - started
        if hold is not None:
            await budgets.commit(hold, completion.input_tokens + completion.output_tokens)
        model = provider.model_for(call.request.model_type)
        self._count(protected, call, model, completion, elapsed)
        return Result(completion, provider.name, model, elapsed)

    async def stream(self, call: Call) -> AsyncIterator[Chunk | Result]:
        """Chunks as the provider sends them, then the ``Result``. A failure before the first chunk
        is retried like any generation; after it, the caller has seen text and the error is final."""
        protected = self.route(call.request.model_type)
        provider = protected.provider
        output, reserve = self._prepare(call)
        started = time.perf_counter()
        hold: Hold | None = None
        completion: Completion | None = None
        try:
            hold = await self.budgets.reserve(call.agent_id, reserve)
            attempt = 0
            while completion is None:
                attempt += 1
                sent = False
                protected.breaker.admit()
                try:
                    async with protected.limiter.slot():
                        # Closed however this generator ends: a caller that stops reading
                        # (a cancelled turn) closes the provider's stream, not the GC.
                        bounded = call.request.bounded(max_tokens=output, timeout=self.provider_timeout)
                        async with contextlib.aclosing(provider.stream(bounded)) as items:  # type: ignore[type-var]
                            async for item in items:
                                if isinstance(item, Completion):
                                    completion = item
                                else:
                                    sent = True
                                    yield item
                except ParleyError as exc:
                    if counts_against_provider(exc):
                        protected.breaker.failure()
                    else:
                        protected.breaker.release()
                    if sent or not exc.retryable or attempt >= self.retry.attempts:
                        raise
                    self.metrics.retries.labels(provider.name, exc.code).inc()
                    await asyncio.sleep(self.retry.delay(attempt, exc, self._rng))
                    continue
                except BaseException:
                    protected.breaker.release()
                    raise
                protected.breaker.success()
                if completion is None:
                    raise errors.PROVIDER_BAD_RESPONSE(f"{provider.name} ended its stream without a result")
        except BaseException as exc:
            self._failed(protected.provider.name, call.request.model_type, exc)
            with contextlib.suppress(ParleyError):
                await asyncio.shield(self.budgets.release(hold))
            raise
        elapsed = time.perf_counter() - started
        await self.budgets.commit(hold, completion.input_tokens + completion.output_tokens)
        model = provider.model_for(call.request.model_type)
        self._count(protected, call, model, completion, elapsed)
        yield Result(completion, provider.name, model, elapsed)

    async def embed(self, agent_id: str, texts: Sequence[str]) -> Embeddings:
        embedder = self.embedder
        reserve = sum(estimate_tokens(t) for t in texts)
        started = time.perf_counter()
        hold: Hold | None = None
        try:
            hold = await self.budgets.reserve(agent_id, reserve)
            result = await embedder.embed(texts, timeout=self.provider_timeout)
        except BaseException as exc:
            self._failed(embedder.name, "EMBEDDING", exc)
            with contextlib.suppress(ParleyError):
                await asyncio.shield(self.budgets.release(hold))
            raise
        await self.budgets.commit(hold, result.input_tokens)
        self.metrics.requests.labels(embedder.name, "EMBEDDING", "ok").inc()
        self.metrics.duration.labels(embedder.name, "EMBEDDING").observe(time.perf_counter() - started)
        self.metrics.tokens.labels(embedder.name, "input").inc(result.input_tokens)
        self.ledger.add(
            agent_id,
            embedder.name,
            embedder.model,
            "",
            "embed",
            Completion("", input_tokens=result.input_tokens),
        )
        return result
