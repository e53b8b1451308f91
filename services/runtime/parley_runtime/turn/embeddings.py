"""Embedding calls shared between turns: the message embeddings computed and stored in batches,
and the calls of an agent made while another is under way sent together (``EmbedCalls``).

A turn's message and reply are embedded after its reply, in the background (the message's
embedding is the one the turn computed already when it searched memories or documents with it).
The turns that hand their texts over within one window (``window`` seconds from the first of
them; 0: until the event loop's next turn) share one embedding call and one statement per agent,
instead of a call and a statement each: under sequential load that background work competed with
the next turn for the CPU (about 0.5 ms of a 3.7 ms turn, docs/performance.md). What arrives
while a batch is being computed and stored goes into the next one.

Each caller awaits its own texts' outcome, so shutdown's drain of the background work still waits
for the writes. When a shared call or statement fails, every caller's texts are tried again on
their own, so a text the gateway refuses (too long, say) or a vector the database refuses fails
only the turn it came from.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from ..store import RuntimeStore

Embed = Callable[[Sequence[str], uuid.UUID], Awaitable[list[list[float]]]]
Memories = Sequence[tuple[uuid.UUID, str]]  # (memory id, its text)
Known = Mapping[uuid.UUID, Sequence[float]]  # embeddings computed already, by memory id

T = TypeVar("T")

MAX_TEXTS = 64  # per embedding call (the gateway takes up to 256)
MAX_SHARED_TEXTS = 256  # the gateway's limit: a call ``EmbedCalls`` puts together stays within it


@dataclass
class _Ask:
    texts: list[str]
    answer: asyncio.Future[list[list[float]]]


class EmbedCalls:
    """An agent's embedding calls made while one of its calls is under way go out together, as one
    call, as soon as that one returns. A call made while none is under way goes out at once, so a
    turn alone waits for nothing; under load one call carries the texts of many turns (each turn
    that searches memories embeds its message before it can search). A shared call that fails is
    made again for each caller on its own, so a text the gateway refuses fails only its own caller.
    A caller that gives up (cancelled) leaves the others' call alone."""

    def __init__(self, embed: Embed, *, max_texts: int = MAX_SHARED_TEXTS) -> None:
        self.embed = embed
        self.max_texts = max_texts
        # Agents with a call under way, and the calls that arrived since (sent when it returns).
        self._waiting: dict[uuid.UUID, list[_Ask]] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    async def __call__(self, texts: Sequence[str], agent_id: uuid.UUID) -> list[list[float]]:
        waiting = self._waiting.get(agent_id)
        if waiting is not None:
            ask = _Ask(list(texts), asyncio.get_running_loop().create_future())
            ask.answer.add_done_callback(_retrieved)
            waiting.append(ask)
            # Not shielded: a caller that gives up cancels its answer, and is left out of the call.
            return await ask.answer
        self._waiting[agent_id] = []
        try:
            return await self.embed(texts, agent_id)
        finally:
            self._next(agent_id)

    def _next(self, agent_id: uuid.UUID) -> None:
        """The call under way returned: send what arrived meanwhile, else the agent is idle."""
        asks = self._waiting.pop(agent_id, [])
        asks = [ask for ask in asks if not ask.answer.done()]
        if not asks:
            return
        self._waiting[agent_id] = []
        task = asyncio.ensure_future(self._send(agent_id, asks))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _send(self, agent_id: uuid.UUID, asks: list[_Ask]) -> None:
        try:
            for group in _groups(asks, lambda ask: len(ask.texts), self.max_texts):
                await self._answer(agent_id, group)
        finally:
            for ask in asks:  # cancelled (the runtime stopping): nobody is left to answer these
                if not ask.answer.done():
                    ask.answer.cancel()
            self._next(agent_id)

    async def _answer(self, agent_id: uuid.UUID, asks: list[_Ask]) -> None:
        texts = [text for ask in asks for text in ask.texts]
        try:
            vectors = await self.embed(texts, agent_id)
            if len(vectors) != len(texts):
                raise RuntimeError(f"the embedding call answered {len(vectors)} of {len(texts)} texts")
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            if len(asks) == 1:
                _answered(asks[0], error=exc)
                return
            for ask in asks:  # only the callers whose texts fail on their own hear it
                try:
                    _answered(ask, await self.embed(ask.texts, agent_id))
                except asyncio.CancelledError:
                    raise
                except Exception as alone:
                    _answered(ask, error=alone)
            return
        start = 0
        for ask in asks:
            _answered(ask, vectors[start : start + len(ask.texts)])
            start += len(ask.texts)


def _groups(items: Sequence[T], size: Callable[[T], int], limit: int) -> list[list[T]]:
    """Items in order, in groups of at most ``limit`` texts (an item with more is a group of its own)."""
    groups: list[list[T]] = []
    total = 0
    for item in items:
        if not groups or total + size(item) > limit:
            groups.append([])
            total = 0
        groups[-1].append(item)
        total += size(item)
    return groups


def _answered(ask: _Ask, vectors: list[list[float]] | None = None, *, error: Exception | None = None) -> None:
    if ask.answer.done():
        return
    if error is not None:
        ask.answer.set_exception(error)
    else:
        ask.answer.set_result(vectors or [])


@dataclass
class _Caller:
    memories: Memories  # to embed
    known: Known  # to store as they are
    done: asyncio.Future[None]

    @property
    def size(self) -> int:
        return len(self.memories) + len(self.known)


@dataclass
class _Batch:
    callers: dict[uuid.UUID, list[_Caller]] = field(default_factory=dict)  # by agent


class MessageEmbeddings:
    def __init__(self, store: RuntimeStore, embed: Embed, *, window: float = 0.0) -> None:
        self.store = store
        self.embed = embed
        self.window = window
        self._gathering: _Batch | None = None
        self._task: asyncio.Task[None] | None = None

    async def add(self, agent_id: uuid.UUID, memories: Memories, known: Known | None = None) -> None:
        """Embed and store these memories' texts with whatever other turns hand over meanwhile;
        the ones in ``known`` (the turn computed them: the message's, to search with it) are stored
        as they are. Raises what embedding or storing them raised."""
        known = dict(known or {})
        memories = [
            (memory_id, text) for memory_id, text in memories if text.strip() and memory_id not in known
        ]
        if not memories and not known:
            return
        if self._gathering is None:
            self._gathering = _Batch()
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        done.add_done_callback(_retrieved)
        self._gathering.callers.setdefault(agent_id, []).append(_Caller(memories, known, done))
        if self._task is None:
            self._task = asyncio.ensure_future(self._run())
        await asyncio.shield(done)

    async def _run(self) -> None:
        try:
            while self._gathering is not None:
                await asyncio.sleep(self.window)
                batch, self._gathering = self._gathering, None
                if batch is None:
                    continue
                for agent_id, callers in batch.callers.items():
                    for chunk in _groups(callers, lambda caller: caller.size, MAX_TEXTS):
                        await self._store(agent_id, chunk)
        finally:
            self._task = None
            if self._gathering is not None:  # stopped (cancelled) with a batch still gathered
                for callers in self._gathering.callers.values():
                    for caller in callers:
                        caller.done.cancel()
                self._gathering = None

    async def _store(self, agent_id: uuid.UUID, callers: list[_Caller]) -> None:
        try:
            await self._embed_and_store(
                agent_id,
                [m for caller in callers for m in caller.memories],
                {k: v for caller in callers for k, v in caller.known.items()},
            )
        except asyncio.CancelledError:
            for caller in callers:
                caller.done.cancel()
            raise
        except Exception as exc:
            if len(callers) == 1:
                _settle(callers[0], exc)
                return
            for caller in callers:  # only the callers whose texts fail on their own hear it
                try:
                    await self._embed_and_store(agent_id, caller.memories, caller.known)
                except asyncio.CancelledError:
                    caller.done.cancel()
                    raise
                except Exception as alone:
                    _settle(caller, alone)
                else:
                    _settle(caller, None)
            return
        for caller in callers:
            _settle(caller, None)

    async def _embed_and_store(self, agent_id: uuid.UUID, memories: Memories, known: Known) -> None:
        vectors = await self.embed([text for _, text in memories], agent_id) if memories else []
        await self.store.set_embeddings(
            agent_id,
            [
                *((memory_id, vector) for (memory_id, _), vector in zip(memories, vectors, strict=True)),
                *known.items(),
            ],
        )


def _settle(caller: _Caller, error: Exception | None) -> None:
    if caller.done.done():
        return
    if error is None:
        caller.done.set_result(None)
    else:
        caller.done.set_exception(error)


def _retrieved(future: asyncio.Future[Any]) -> None:
    """A caller that gave up (cancelled) no longer awaits its outcome: nothing to report then."""
    if not future.cancelled():
        future.exception()
