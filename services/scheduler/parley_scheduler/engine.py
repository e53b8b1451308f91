"""One replica's engine: the claim loop, the runs it spawns, and maintenance.

- the **claim loop** takes a batch of due tasks in one SKIP LOCKED statement
  and sleeps until the next due time, a NOTIFY from the database, or the poll
  interval, whichever comes first (an idle queue costs one query per interval);
- each claimed task is **run** by the dispatcher (``dispatch``): sent to its
  worker with the lease, kept alive by heartbeats, completed fenced by the lease
  token through the completer's group commit (``completer``);
- **maintenance** refreshes the due gauge, prunes uncertain attempts past their retention and
  resumes orphaned tasks whose worker is back.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import socket
from typing import Any

import nats.errors

from parley_platform.bus import Bus
from parley_platform.errors import ParleyError
from parley_platform.logging import get_logger
from parley_platform.retry import Backoff
from parley_platform.worker import PROBE_HEADER, run_subject

from . import domain
from .config import EngineConfig
from .dispatch import Dispatcher
from .metrics import SchedulerMetrics
from .store import Claimed, SchedulerStore, due_hints

log = get_logger(__name__)

# A claim that failed (a database outage, or a bug) is tried again after this, at most the poll interval.
CLAIM_BACKOFF = Backoff(base=0.2, cap=6.4)


def default_replica_name() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"


class _Slot:
    """One of a replica's dispatch slots, held from the claim until the worker answers."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.held = True
        engine._occupy()

    def release(self) -> None:
        if self.held:
            self.held = False
            self.engine._vacate()


class Engine:
    def __init__(
        self,
        *,
        store: SchedulerStore,
        bus: Bus,
        config: EngineConfig,
        metrics: SchedulerMetrics,
        database_url: str,
        claim_loop: bool = True,
    ) -> None:
        self.store = store
        self.bus = bus
        self.config = config
        self.metrics = metrics
        self.database_url = database_url
        self.claim_loop = claim_loop  # False in serverless mode: RunDueTasks claims instead
        self.dispatcher = Dispatcher(store=store, bus=bus, config=config, metrics=metrics, wake=self.wake)
        self._wake = asyncio.Event()
        self._slot_freed = asyncio.Event()
        self._busy = 0
        self._stopping = asyncio.Event()
        self._loops: list[asyncio.Task[None]] = []
        self._runs: set[asyncio.Task[Any]] = set()
        self._listening = False
        metrics.watch_inflight(lambda: self._busy)

    # --- life cycle -------------------------------------------------------------------------

    async def start(self) -> None:
        await self.dispatcher.start()
        self._loops.append(asyncio.create_task(self._maintenance(), name="scheduler-maintenance"))
        if self.claim_loop:
            self._loops.append(asyncio.create_task(self._listen(), name="scheduler-listen"))
            self._loops.append(asyncio.create_task(self._claim_loop(), name="scheduler-claim"))

    async def stop(self, timeout: float) -> None:
        """Stop claiming, let runs in flight finish for up to ``timeout``, give up the rest's leases."""
        self._stopping.set()
        self._wake.set()
        for loop in self._loops:
            loop.cancel()
        await asyncio.gather(*self._loops, return_exceptions=True)
        busy = set(self._runs) | set(self.dispatcher.extending)
        if busy:
            _, pending = await asyncio.wait(busy, timeout=timeout)
            abandoned = list(self.dispatcher.inflight.values())
            for run in pending:
                run.cancel()
            if pending:
                await asyncio.wait(pending, timeout=2)
            await self.dispatcher.release_abandoned(abandoned)
        await self.dispatcher.close()

    def spawn(self, claimed: Claimed) -> asyncio.Task[domain.RunReport]:
        slot = _Slot(self)
        run = asyncio.create_task(self.dispatcher.run(claimed, slot.release))
        self._runs.add(run)

        def done(task: asyncio.Task[domain.RunReport]) -> None:
            self._runs.discard(task)
            slot.release()

        run.add_done_callback(done)
        return run

    def _occupy(self) -> None:
        self._busy += 1

    def _vacate(self) -> None:
        self._busy -= 1
        self._slot_freed.set()

    # --- the claim loop ---------------------------------------------------------------------

    async def _claim_loop(self) -> None:
        cfg = self.config
        failures = 0
        # Near capacity, wait until a useful batch can be claimed rather than claiming the
        # slots one by one as they free up: a claim costs a statement however few rows it takes.
        worth_claiming = max(1, min(cfg.batch_size, cfg.max_inflight // 4))
        while not self._stopping.is_set():
            free = cfg.max_inflight - self._busy
            if free <= 0 or (free < worth_claiming and self._busy > 0):
                self._slot_freed.clear()
                await self._slot_freed.wait()
                continue
            limit = min(cfg.batch_size, free)
            self._wake.clear()
            try:
                batch = await self.store.claim_due(cfg.owner, cfg.lease_ms, limit)
                failures = 0
            except Exception as exc:
                # The loop outlives any failure: a database outage, or a bug, is retried with backoff.
                failures += 1
                if isinstance(exc, ParleyError):
                    log.warning("claim failed", error=str(exc), attempt=failures)
                else:
                    log.exception("claim crashed", attempt=failures)
                await self._sleep(min(cfg.poll_interval, CLAIM_BACKOFF.delay(failures)))
                continue
            for claimed in batch:
                if claimed.reclaimed:
                    self.metrics.lease_expired.inc()
                self.spawn(claimed)
            if len(batch) >= limit:
                continue
            try:
                at, db_now = await self.store.next_wakeup()
            except ParleyError as exc:
                log.warning("next wake-up unknown", error=str(exc))
                at, db_now = None, None
            delay = cfg.poll_interval
            if at is not None and db_now is not None:
                delay = min(cfg.poll_interval, (at - db_now).total_seconds())
            if delay <= 0:
                if batch:
                    continue
                # Due but locked by another replica's claim: look again shortly.
                delay = 0.01
            await self._sleep(delay)

    async def _sleep(self, seconds: float) -> None:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(seconds):
                await self._wake.wait()

    def wake(self) -> None:
        self._wake.set()

    async def _listen(self) -> None:
        """Wake the claim loop on the trigger's hints that something became due; listen again when the
        connection drops (meanwhile the loop polls)."""
        while not self._stopping.is_set():
            try:
                async for _ in due_hints(self.database_url):
                    self._listening = True
                    self._wake.set()
            except ParleyError as exc:
                log.warning("listen connection lost, polling meanwhile", error=str(exc))
            self._listening = False
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(1.0):
                    await self._stopping.wait()

    # --- maintenance ------------------------------------------------------------------------

    async def _maintenance(self) -> None:
        while not self._stopping.is_set():
            try:
                self.metrics.due.set(await self.store.count_due())
                pruned = await self.store.prune_uncertain(self.config.uncertain_retention_ms)
                if pruned:
                    log.info("uncertain attempts past their retention pruned", count=pruned)
                for name in await self.store.orphaned_names():
                    if await self.worker_present(name):
                        resumed = await self.store.resume_orphans(name)
                        if resumed:
                            log.info("orphaned tasks resumed, worker is back", worker=name, tasks=resumed)
                            self._wake.set()
            except ParleyError as exc:
                log.warning("maintenance failed", error=str(exc))
            except Exception:
                log.exception("maintenance crashed")
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.config.maintenance_interval):
                    await self._stopping.wait()

    async def worker_present(self, name: str) -> bool:
        """Whether anyone serves the worker name: a probe request that runs nothing."""
        try:
            await self.bus.nc.request(
                run_subject(self.bus.subjects, name), b"", timeout=1.0, headers={PROBE_HEADER: "1"}
            )
        except nats.errors.NoRespondersError:
            return False
        except (nats.errors.TimeoutError, nats.errors.Error):
            # Someone holds the subject but did not answer in time: busy, not absent.
            return True
        return True
