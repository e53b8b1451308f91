"""The prompt batcher's I/O: sections in PostgreSQL, drains serialised per affinity, results on NATS.

A drain takes the affinity's lease and claims its due sections (one statement; a live lease
elsewhere means wait), packs them into calls that run through the same engine as every other
generation, splits the answers back per section, retries what came back missing or invalid, falls
back after that, stores the results and gives the lease back (one statement), and publishes them.

When drains happen is drains.py's business: the scheduler's BATCHER_DRAIN task per affinity, or,
for a gateway without the scheduler (``PARLEY_BATCHER_SELF_DRAIN=true``), a timer.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field
from typing import Any

from parley.v1 import model_pb2
from parley_clients.batcher import result_subject
from parley_platform.bus import Bus
from parley_platform.errors import ParleyError
from parley_platform.logging import get_logger

from . import errors
from .batching import (
    BatcherConfig,
    Call,
    Outcome,
    Section,
    build_prompt,
    call_keys,
    extract_fields,
    pack,
    split_answer,
)
from .engine import Call as EngineCall
from .engine import Engine, GatewayMetrics
from .grammar import fields_grammar
from .provider import ProviderRequest
from .records import AffinityStatus
from .store import GatewayStore

log = get_logger(__name__)


@dataclass
class Drained:
    affinity: str
    seq: int
    sections: int
    calls: int
    results: list[model_pb2.SectionResult] = field(default_factory=list)


def affinity_label(affinity: str) -> str:
    """Metric label: ``room:<id>`` would be one series per room, so rooms share ``room``."""
    return affinity.split(":", 1)[0]


class Batcher:
    def __init__(
        self,
        *,
        store: GatewayStore,
        engine: Engine,
        bus: Bus,
        config: BatcherConfig,
        metrics: GatewayMetrics,
        holder: str,
        lease_seconds: float,
    ) -> None:
        self.store = store
        self.engine = engine
        self.bus = bus
        self.config = config
        self.metrics = metrics
        self.holder = holder
        self.lease_seconds = lease_seconds
        self._locks: dict[str, asyncio.Lock] = {}
        self._gauged: set[str] = set()  # the labels of parley_batcher_sections set so far

    async def add(self, section: Section) -> bool:
        return await self.store.add_section(section)

    def draining(self, affinity: str) -> bool:
        lock = self._locks.get(affinity)
        return lock is not None and lock.locked()

    async def drain(self, affinity: str, *, wait: float = 30.0) -> Drained:
        """Drain one affinity; a drain already running (here or on another replica) is waited for."""
        lock = self._locks.setdefault(affinity, asyncio.Lock())
        async with lock:
            deadline = time.monotonic() + wait
            while True:
                claimed = await self.store.claim_drain(affinity, self.holder, self.lease_seconds)
                if claimed is not None:
                    break
                if time.monotonic() > deadline:
                    raise errors.DRAIN_BUSY(
                        f"affinity {affinity} is being drained elsewhere and did not finish"
                        f" within {wait:.0f}s"
                    )
                await asyncio.sleep(0.02)
            drained = Drained(affinity, claimed.seq, len(claimed.sections), 0)
            try:
                async with asyncio.timeout(max(1.0, self.lease_seconds - 5)):
                    if claimed.sections:
                        drained.results, drained.calls = await self._answer(
                            affinity, claimed.seq, list(claimed.sections)
                        )
                    stored = [(r.agent_id, r.section_id, _result_json(r)) for r in drained.results]
                    await self.store.finish_drain(affinity, claimed, stored, calls=drained.calls)
            except BaseException:
                # Nothing finished: the lease is given back, and the next drain claims the sections.
                with contextlib.suppress(ParleyError):
                    await asyncio.shield(self.store.finish_drain(affinity, claimed, [], calls=drained.calls))
                raise
            for result in drained.results:
                await self._publish(result)
            if drained.sections:
                log.info(
                    "drained",
                    affinity=affinity,
                    seq=claimed.seq,
                    sections=drained.sections,
                    calls=drained.calls,
                )
            return drained

    async def _publish(self, result: model_pb2.SectionResult) -> None:
        subject = result_subject(self.bus.subjects.ns, result.agent_id, result.section_id)
        try:
            await self.bus.publish_core(subject, result.SerializeToString())
        except ParleyError as exc:
            # The result is stored with the section as well; a missed publish is not a lost result.
            log.warning("batcher result not published", section_id=result.section_id, code=exc.code)

    async def _answer(
        self, affinity: str, seq: int, sections: list[Section]
    ) -> tuple[list[model_pb2.SectionResult], int]:
        started = time.perf_counter()
        attempts = {(s.agent_id, s.id): 0 for s in sections}
        final: dict[tuple[str, str], tuple[Outcome, bool]] = {}
        to_run = sections
        calls_made = 0
        slots = asyncio.Semaphore(self.config.max_parallel_calls)
        while to_run:
            calls = pack(to_run, self.config)
            calls_made += len(calls)

            async def run(call: Call) -> list[tuple[Section, Outcome]]:
                async with slots:
                    return await self._call(call)

            answered = await asyncio.gather(*(run(c) for c in calls))
            retry: list[Section] = []
            for pairs in answered:
                for section, outcome in pairs:
                    key = (section.agent_id, section.id)
                    attempts[key] += 1
                    if outcome.ok:
                        final[key] = (outcome, False)
                    elif attempts[key] <= section.max_retries:
                        retry.append(section)
                    else:
                        final[key] = (outcome, True)
            to_run = retry
        duration = time.perf_counter() - started
        results = []
        for section in sections:
            key = (section.agent_id, section.id)
            outcome, fell_back = final[key]
            results.append(
                model_pb2.SectionResult(
                    section_id=section.id,
                    agent_id=section.agent_id,
                    affinity=affinity,
                    fields=dict(section.fallback) if fell_back else outcome.fields,
                    fallback_used=fell_back,
                    attempts=attempts[key],
                    error=outcome.error,
                    drain_seq=seq,
                    duration_seconds=duration,
                )
            )
        return results, calls_made

    async def _call(self, call: Call) -> list[tuple[Section, Outcome]]:
        self.metrics.batcher_calls.inc()
        self.metrics.batcher_sections_per_call.observe(len(call.sections))
        keys = call_keys(call)
        system, prompt = build_prompt(call)
        max_tokens = min(4096, 32 + 96 * len(keys))
        request = ProviderRequest(
            model_type=call.tier,
            prompt=prompt,
            system=system,
            max_tokens=max_tokens,
            grammar=fields_grammar(keys, max_tokens),
            temperature=0.2,
        )
        try:
            result = await self.engine.generate(EngineCall(call.agent_id, request, kind="batch"))
        except ParleyError as exc:
            failed = Outcome({}, f"{exc.code}: {exc.message}"[:500])
            return [(section, failed) for section in call.sections]
        found = extract_fields(result.completion.text, keys)
        return [(section, split_answer(section, found)) for section in call.sections]

    async def refresh_gauges(self) -> list[AffinityStatus]:
        statuses = await self.store.batcher_status("")
        pending: dict[str, int] = {}
        for status in statuses:
            label = affinity_label(status.affinity)
            pending[label] = pending.get(label, 0) + status.pending
        # An affinity with nothing left to deliver is not listed: its label falls to 0.
        for label in self._gauged - pending.keys():
            pending[label] = 0
        for label, count in pending.items():
            self.metrics.batcher_sections.labels(label).set(count)
        self._gauged = set(pending)
        return statuses


def drain_interval_ms(config: BatcherConfig, min_cycle_ms: int | None) -> int:
    """Each affinity drains at its shortest recurring cycle, never less often than the maximum interval."""
    if min_cycle_ms:
        return min(int(min_cycle_ms), config.max_drain_interval_ms)
    return config.max_drain_interval_ms


def _result_json(result: model_pb2.SectionResult) -> dict[str, Any]:
    return {
        "fields": dict(result.fields),
        "fallback_used": result.fallback_used,
        "attempts": result.attempts,
        "error": result.error,
        "drain_seq": result.drain_seq,
    }
