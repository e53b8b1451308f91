"""The completion writer: the outcomes of many runs in one statement, each fenced by its lease token."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field

from parley_platform.errors import ParleyError
from parley_platform.logging import get_logger
from parley_platform.retry import Backoff, retrying

from . import domain
from .store import Claimed, SchedulerStore, completion_row

log = get_logger(__name__)

# A batch is written again after a retryable failure (a lost connection, a serialization failure);
# its runs' leases keep their tasks from being claimed meanwhile.
WRITE_ATTEMPTS = 4
WRITE_BACKOFF = Backoff(base=0.05, cap=0.2)


@dataclass
class _Pending:
    claimed: Claimed
    completion: domain.Completion
    done: asyncio.Future[tuple[bool, bool]] = field(repr=False)


class Completer:
    """Group commit of completions: whatever piled up while one batch was written goes in the next."""

    def __init__(self, store: SchedulerStore, max_batch: int = 1000) -> None:
        self.store = store
        self.max_batch = max_batch
        self._pending: list[_Pending] = []
        self._ready = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._closing = False

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="scheduler-completer")

    async def complete(self, claimed: Claimed, completion: domain.Completion) -> tuple[bool, bool]:
        """Write one outcome; returns (applied, deleted). Not applied: the lease was lost."""
        future: asyncio.Future[tuple[bool, bool]] = asyncio.get_running_loop().create_future()
        self._pending.append(_Pending(claimed, completion, future))
        self._ready.set()
        return await future

    async def _loop(self) -> None:
        while True:
            await self._ready.wait()
            self._ready.clear()
            while self._pending:
                batch, self._pending = self._pending[: self.max_batch], self._pending[self.max_batch :]
                try:
                    await self._write(batch)
                except Exception as exc:
                    # Never leave a run waiting forever: its lease expires and the slot runs again.
                    log.exception("completions failed", runs=len(batch))
                    for p in batch:
                        if not p.done.done():
                            p.done.set_exception(exc)
            if self._closing:
                return

    async def _write(self, batch: list[_Pending]) -> None:
        deletes = [(p.claimed.id, p.claimed.token) for p in batch if p.completion.delete]
        updates = [completion_row(p.claimed, p.completion) for p in batch if not p.completion.delete]
        try:
            applied = await retrying(
                lambda: self.store.finish(deletes, updates), attempts=WRITE_ATTEMPTS, backoff=WRITE_BACKOFF
            )
        except ParleyError as exc:
            log.error("completions not written", error=str(exc), runs=len(batch))
            for p in batch:
                if not p.done.done():
                    p.done.set_exception(exc)
            return
        for p in batch:
            key = str(p.claimed.id)
            if not p.done.done():
                p.done.set_result((key in applied, applied.get(key, False)))

    async def close(self, timeout: float) -> None:
        self._closing = True
        self._ready.set()
        if self._task is not None:
            with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
                await asyncio.wait_for(self._task, timeout)
