"""The message embeddings of concurrent turns, written together.

A turn's message and reply embeddings are stored after its reply, in the background. Each batch
is one statement per agent; what arrives while a batch is being written goes into the next one.
A turn alone waits for nothing more than its own statement; under load, turns share statements
(one UPDATE for many turns instead of one each). A caller awaits its own batch, so shutdown's
drain of the background work still waits for the writes, and a failure reaches its caller.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Sequence

from ..store import RuntimeStore

Embedding = tuple[uuid.UUID, Sequence[float]]


class EmbeddingWriter:
    def __init__(self, store: RuntimeStore) -> None:
        self.store = store
        self._pending: dict[uuid.UUID, list[Embedding]] = {}
        self._done: asyncio.Future[None] | None = None  # the batch being gathered is written
        self._task: asyncio.Task[None] | None = None  # writing

    async def write(self, agent_id: uuid.UUID, embeddings: Sequence[Embedding]) -> None:
        """Store these embeddings, with whatever other turns hand over meanwhile. Raises what the
        statement of its batch raised (for any agent of the batch)."""
        if not embeddings:
            return
        self._pending.setdefault(agent_id, []).extend(embeddings)
        if self._done is None:
            self._done = asyncio.get_running_loop().create_future()
        done = self._done
        if self._task is None:
            self._task = asyncio.ensure_future(self._run())
        await asyncio.shield(done)

    async def _run(self) -> None:
        try:
            while self._pending:
                batch, done = self._pending, self._done
                self._pending, self._done = {}, None
                assert done is not None
                failed: Exception | None = None
                for agent_id, embeddings in batch.items():
                    try:
                        await self.store.set_embeddings(agent_id, embeddings)
                    except Exception as exc:
                        failed = failed or exc
                    except BaseException:
                        done.cancel()
                        raise
                if failed is None:
                    done.set_result(None)
                else:
                    done.set_exception(failed)
        finally:
            self._task = None
            if self._done is not None:  # stopped (cancelled) with a batch still gathered
                self._done.cancel()
                self._done, self._pending = None, {}
