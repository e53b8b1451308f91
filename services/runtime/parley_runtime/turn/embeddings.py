"""The message embeddings of a replica's turns, computed and stored in batches.

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

from ..store import RuntimeStore

Embed = Callable[[Sequence[str], uuid.UUID], Awaitable[list[list[float]]]]
Memories = Sequence[tuple[uuid.UUID, str]]  # (memory id, its text)
Known = Mapping[uuid.UUID, Sequence[float]]  # embeddings computed already, by memory id

MAX_TEXTS = 64  # per embedding call (the gateway takes up to 256)


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
                    for chunk in _chunks(callers):
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


def _chunks(callers: list[_Caller]) -> list[list[_Caller]]:
    """Callers in groups of at most MAX_TEXTS texts (a caller with more is a group of its own)."""
    chunks: list[list[_Caller]] = []
    size = 0
    for caller in callers:
        if not chunks or size + caller.size > MAX_TEXTS:
            chunks.append([])
            size = 0
        chunks[-1].append(caller)
        size += caller.size
    return chunks


def _settle(caller: _Caller, error: Exception | None) -> None:
    if caller.done.done():
        return
    if error is None:
        caller.done.set_result(None)
    else:
        caller.done.set_exception(error)


def _retrieved(future: asyncio.Future[None]) -> None:
    """A caller that gave up (cancelled) no longer awaits its outcome: nothing to report then."""
    if not future.cancelled():
        future.exception()
