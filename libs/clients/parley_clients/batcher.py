"""The prompt batcher's client helpers, for any service that asks the model gateway small questions.

The gateway keeps the sections and drains them (see the model-gateway spec);
this module registers sections over NATS RPC and hands their results back:

- ``ask_once``: a start-up question, answered at the next drain of its affinity; returns the fields.
- ``ask_now``: an immediate question: registers it, drains its affinity now, and returns the
  fields, or the fallback (required) on any failure.
- ``ask_together``: several immediate questions of one affinity, registered then drained once (one
  model call when they fit), each with its fallback on failure.
- ``on_drain``: a section answered at every drain until disposed; the returned future resolves with
  the first result, ``on_result`` is called with every one.
- ``think``: a recurring section (autonomy), at most once per ``min_cycle_ms``, results to ``on_result``.
- ``listen`` / ``forget``: hand a section's results to a callback, or stop, whoever registered it.
- ``dispose``: removes every section this client registered and fails whatever still waits.

Results travel on ``<ns>.model.batcher.result.<agent_id>.<section_id>`` (core NATS).
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from google.protobuf.message import DecodeError

from parley.v1 import model_pb2
from parley.v1.model_nats import ModelGatewayClient
from parley_platform.bus import Bus
from parley_platform.errors import ParleyError
from parley_platform.logging import get_logger
from parley_platform.rpc import RpcClient

from . import codes

log = get_logger(__name__)

OnResult = Callable[[model_pb2.SectionResult], Awaitable[None] | None]


def result_subject(namespace: str, agent_id: str, section_id: str) -> str:
    return f"{namespace}.model.batcher.result.{agent_id}.{section_id}"


@dataclass(frozen=True)
class Field:
    name: str
    description: str = ""
    optional: bool = False
    pattern: str = ""

    def to_proto(self) -> model_pb2.SchemaField:
        return model_pb2.SchemaField(
            name=self.name, description=self.description, optional=self.optional, pattern=self.pattern
        )


FieldSpec = Field | str


def _fields(fields: Sequence[FieldSpec]) -> list[model_pb2.SchemaField]:
    return [(Field(f) if isinstance(f, str) else f).to_proto() for f in fields]


class BatcherClient:
    def __init__(self, bus: Bus, agent_id: str, *, owner: str | None = None, timeout: float = 30.0) -> None:
        self.bus = bus
        self.gateway = ModelGatewayClient(RpcClient(bus), timeout=timeout)
        self.timeout = timeout
        self.agent_id = agent_id
        self.owner = owner or f"client-{secrets.token_hex(6)}"
        self._first: dict[str, asyncio.Future[model_pb2.SectionResult]] = {}
        self._callbacks: dict[str, OnResult] = {}
        # A result can arrive twice (published, and in the reply of a Drain this client asked for).
        self._delivered: dict[str, int] = {}
        self._sub: Any = None
        self._disposed = False

    async def _ensure_subscribed(self) -> None:
        if self._disposed:
            raise codes.BATCHER_DISPOSED("this batcher client was disposed")
        if self._sub is None:
            subject = result_subject(self.bus.subjects.ns, self.agent_id, "*")
            self._sub = await self.bus.subscribe(subject, self._on_result)

    async def _on_result(self, msg: Any) -> None:
        try:
            result = model_pb2.SectionResult.FromString(msg.data)
        except DecodeError:
            return
        self.deliver(result)

    def deliver(self, result: model_pb2.SectionResult) -> None:
        """Hand a result to whoever waits for it (first-result future, then the callback), once per drain."""
        if self._delivered.get(result.section_id) == result.drain_seq:
            return
        self._delivered[result.section_id] = result.drain_seq
        future = self._first.pop(result.section_id, None)
        if future is not None and not future.done():
            future.set_result(result)
        callback = self._callbacks.get(result.section_id)
        if callback is not None:
            outcome = callback(result)
            if asyncio.iscoroutine(outcome):
                task = asyncio.ensure_future(outcome)
                task.add_done_callback(_log_callback_failure)

    def section(
        self,
        id: str,
        prompt: str,
        fields: Sequence[FieldSpec],
        *,
        affinity: str = "default",
        priority: int = model_pb2.SECTION_PRIORITY_NORMAL,
        frequency: int = model_pb2.SECTION_FREQUENCY_ONCE,
        fallback: Mapping[str, str] | None = None,
        model_type: int = model_pb2.MODEL_TYPE_TEXT_SMALL,
        isolated: bool = False,
        min_cycle_ms: int = 0,
        max_retries: int = 1,
        system: str = "",
    ) -> model_pb2.Section:
        return model_pb2.Section(
            id=id,
            agent_id=self.agent_id,
            affinity=affinity,
            priority=priority,  # type: ignore[arg-type]
            model_type=model_type,  # type: ignore[arg-type]
            isolated=isolated,
            prompt=prompt,
            fields=_fields(fields),
            fallback=dict(fallback or {}),
            frequency=frequency,  # type: ignore[arg-type]
            min_cycle_ms=min_cycle_ms,
            max_retries=max_retries,
            owner=self.owner,
            system=system,
        )

    async def add_section(self, section: model_pb2.Section) -> bool:
        """Register a section; False when one with its id was already registered for the agent."""
        await self._ensure_subscribed()
        reply = await self.gateway.AddSection(model_pb2.AddSectionRequest(section=section))
        return bool(reply.registered)

    async def _register(
        self, section: model_pb2.Section, on_result: OnResult | None
    ) -> asyncio.Future[model_pb2.SectionResult] | None:
        await self._ensure_subscribed()
        future: asyncio.Future[model_pb2.SectionResult] = asyncio.get_running_loop().create_future()
        # Listen before registering: a drain may deliver before AddSection's reply arrives.
        self._first[section.id] = future
        if on_result is not None:
            self._callbacks[section.id] = on_result
        try:
            registered = await self.add_section(section)
        except BaseException:
            self._first.pop(section.id, None)
            self._callbacks.pop(section.id, None)
            raise
        if not registered:
            self._first.pop(section.id, None)
            if on_result is not None and self._callbacks.get(section.id) is on_result:
                self._callbacks.pop(section.id, None)
            return None
        return future

    async def drain(self, affinity: str) -> model_pb2.DrainResponse:
        reply = await self.gateway.Drain(model_pb2.DrainRequest(affinity=affinity))
        for result in reply.results:
            if result.agent_id == self.agent_id:
                self.deliver(result)
        return reply

    async def ask_once(
        self,
        id: str,
        prompt: str,
        fields: Sequence[FieldSpec],
        *,
        affinity: str = "init",
        timeout: float | None = None,
        **options: Any,
    ) -> dict[str, str] | None:
        """The fields of a once-section, after the drain that answers it; None for a duplicate id."""
        future = await self._register(self.section(id, prompt, fields, affinity=affinity, **options), None)
        if future is None:
            return None
        async with asyncio.timeout(timeout if timeout is not None else self.timeout):
            result = await future
        return dict(result.fields)

    async def ask_now(
        self,
        id: str,
        prompt: str,
        fields: Sequence[FieldSpec],
        *,
        fallback: Mapping[str, str],
        affinity: str = "default",
        timeout: float | None = None,
        **options: Any,
    ) -> dict[str, str]:
        """Ask and drain at once; any failure (timeout, gateway down, bad answer) gives the fallback."""
        section = self.section(
            id,
            prompt,
            fields,
            affinity=affinity,
            priority=model_pb2.SECTION_PRIORITY_IMMEDIATE,
            fallback=fallback,
            **options,
        )
        try:
            async with asyncio.timeout(timeout if timeout is not None else self.timeout):
                future = await self._register(section, None)
                if future is None:
                    return dict(fallback)
                if not future.done():
                    await self.drain(affinity)
                result = await future
        except (ParleyError, TimeoutError) as exc:
            log.info("ask_now fell back", section_id=id, error=getattr(exc, "code", "TIMEOUT"))
            self._first.pop(id, None)
            return dict(fallback)
        return dict(result.fields)

    async def ask_together(
        self,
        sections: Sequence[model_pb2.Section],
        *,
        affinity: str,
        timeout: float | None = None,
        window: float = 0.0,
    ) -> dict[str, model_pb2.SectionResult]:
        """Register ``sections`` (of ``affinity``) and drain it once: one model call answers them all
        when they fit one call. With a ``window`` (seconds), first wait that long for a drain by
        someone else (the scheduler's, another caller's of the same affinity), so the sections of
        several callers share calls. Every section gets a result: the answer, or its fallback (the
        batcher's, after the section's retries; here, when the gateway failed or was late). The
        answered sections are then removed from the gateway."""
        futures: dict[str, asyncio.Future[model_pb2.SectionResult]] = {}
        error = ""
        try:
            async with asyncio.timeout(timeout if timeout is not None else self.timeout):
                for section in sections:
                    future = await self._register(section, None)
                    if future is not None:
                        futures[section.id] = future
                if futures and window > 0:
                    await asyncio.wait(futures.values(), timeout=window)
                if futures and not all(f.done() for f in futures.values()):
                    await self.drain(affinity)
                if futures:
                    await asyncio.wait(futures.values())
        except (ParleyError, TimeoutError) as exc:
            error = getattr(exc, "code", "TIMEOUT")
            log.info("ask_together fell back", affinity=affinity, error=error)
        results: dict[str, model_pb2.SectionResult] = {}
        for section in sections:
            future = futures.get(section.id)
            if future is not None and future.done() and not future.cancelled() and not future.exception():
                results[section.id] = future.result()
                continue
            self._first.pop(section.id, None)
            results[section.id] = model_pb2.SectionResult(
                section_id=section.id,
                agent_id=section.agent_id,
                affinity=affinity,
                fields=dict(section.fallback),
                fallback_used=True,
                error=error or "DUPLICATE_SECTION",
            )
        if futures:  # once delivered they are history: keep the gateway's table small
            with contextlib.suppress(ParleyError, TimeoutError):
                await self.gateway.DisposeSections(
                    model_pb2.DisposeSectionsRequest(agent_id=self.agent_id, section_ids=list(futures))
                )
        return results

    async def on_drain(
        self,
        id: str,
        prompt: str,
        fields: Sequence[FieldSpec],
        *,
        affinity: str = "default",
        on_result: OnResult | None = None,
        **options: Any,
    ) -> asyncio.Future[model_pb2.SectionResult] | None:
        """Register a per-drain section; the future resolves with its first result (None: duplicate id)."""
        section = self.section(
            id, prompt, fields, affinity=affinity, frequency=model_pb2.SECTION_FREQUENCY_PER_DRAIN, **options
        )
        return await self._register(section, on_result)

    async def think(
        self,
        id: str,
        prompt: str,
        fields: Sequence[FieldSpec],
        *,
        on_result: OnResult,
        min_cycle_ms: int,
        affinity: str = "autonomy",
        **options: Any,
    ) -> bool:
        """Register a recurring section whose every result goes to ``on_result``."""
        section = self.section(
            id,
            prompt,
            fields,
            affinity=affinity,
            frequency=model_pb2.SECTION_FREQUENCY_RECURRING,
            min_cycle_ms=min_cycle_ms,
            priority=model_pb2.SECTION_PRIORITY_BACKGROUND,
            **options,
        )
        future = await self._register(section, on_result)
        if future is None:
            return False
        self._first.pop(id, None)
        return True

    async def listen(self, id: str, on_result: OnResult) -> None:
        """Hand every result of section ``id`` to ``on_result``, whoever registered it: a section
        registered under a shared owner by another process (``think`` returned False)."""
        await self._ensure_subscribed()
        self._callbacks[id] = on_result

    def forget(self, id: str) -> None:
        """Stop handing the results of section ``id`` to its callback (the section stays registered)."""
        self._callbacks.pop(id, None)
        self._first.pop(id, None)

    async def dispose(self) -> int:
        """Remove this client's sections from the gateway and fail every wait still open."""
        if self._disposed:
            return 0
        self._disposed = True
        disposed = 0
        try:
            reply = await self.gateway.DisposeSections(
                model_pb2.DisposeSectionsRequest(agent_id=self.agent_id, owner=self.owner)
            )
            disposed = reply.disposed
        finally:
            if self._sub is not None:
                with contextlib.suppress(Exception):
                    await self._sub.unsubscribe()
                self._sub = None
            for future in self._first.values():
                if not future.done():
                    future.set_exception(
                        codes.BATCHER_DISPOSED("the batcher client was disposed before a result came")
                    )
                    # Whoever still awaits it gets the error; one that stopped waiting (a turn
                    # cancelled at shutdown) leaves nothing to report as never retrieved.
                    future.exception()
            self._first.clear()
            self._callbacks.clear()
        return disposed


def _log_callback_failure(task: asyncio.Future[Any]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.warning("batcher on_result callback failed", error=type(task.exception()).__name__)
