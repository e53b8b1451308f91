"""When the prompt batcher drains: the scheduler's job, through one repeating BATCHER_DRAIN task
per affinity (spec: model gateway, "Prompt batcher").

The first section of an affinity that a gateway replica sees creates the affinity's task (an id
derived from the affinity, so every replica names the same task and the scheduler keeps one).
Each run drains the affinity and answers the interval until the next: the shortest
``min_cycle_ms`` of its recurring sections, capped by ``MAX_DRAIN_INTERVAL_MS`` (adaptive
``next_interval``). A run is asked for at once, through the scheduler, when ``BATCH_SIZE``
sections were added since the last drain here, or when a recurring section wants a shorter
cycle than the task has. The batcher owns how a drain happens; this module only says when.
``PARLEY_BATCHER_SELF_DRAIN=true`` drains on a timer in the gateway instead (``DrainTimer``, no
scheduler).
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections import Counter
from functools import partial

from parley.v1 import scheduler_pb2
from parley.v1.scheduler_nats import SchedulerClient
from parley_platform.convert import set_now
from parley_platform.errors import Conflict, ParleyError
from parley_platform.logging import get_logger
from parley_platform.worker import Lease, Task, TaskResult, Workers

from . import errors
from .batcher import Batcher, Drained, drain_interval_ms
from .batching import Section

log = get_logger(__name__)

BATCHER_DRAIN = "BATCHER_DRAIN"
# Tasks belong to an agent; the batcher's belong to the gateway itself.
GATEWAY_AGENT = uuid.uuid5(uuid.NAMESPACE_URL, "parley:model-gateway")
DRAIN_WAIT_SECONDS = 30.0


def drain_task_id(affinity: str) -> uuid.UUID:
    return uuid.uuid5(GATEWAY_AGENT, f"task:{BATCHER_DRAIN}:{affinity}")


class ScheduledDrains:
    def __init__(self, batcher: Batcher, scheduler: SchedulerClient) -> None:
        self.batcher = batcher
        self.scheduler = scheduler
        self._intervals: dict[str, int] = {}  # affinities whose task exists, and its interval
        self._added: Counter[str] = Counter()  # sections added here since this replica's last drain

    def workers(self) -> Workers:
        workers = Workers()

        @workers.worker(BATCHER_DRAIN)
        async def drain(task: Task, lease: Lease) -> TaskResult:
            affinity = str(task.values.get("affinity") or "")
            if not affinity:
                raise errors.BATCHER_DRAIN_INVALID("a BATCHER_DRAIN task needs values.affinity")
            self._added[affinity] = 0
            await self.batcher.drain(affinity, wait=DRAIN_WAIT_SECONDS)
            interval = await self.interval(affinity)
            self._intervals[affinity] = interval
            return TaskResult(next_interval_ms=interval)

        return workers

    async def interval(self, affinity: str) -> int:
        """The affinity's drain interval from the sections registered now."""
        shortest = None
        for status in await self.batcher.store.batcher_status(affinity):
            shortest = status.min_cycle_ms
        return drain_interval_ms(self.batcher.config, shortest)

    async def on_added(self, section: Section) -> None:
        """After a section is stored: make sure its affinity drains, and soon enough."""
        affinity = section.affinity
        wanted = drain_interval_ms(
            self.batcher.config, section.min_cycle_ms if section.frequency == "recurring" else None
        )
        self._added[affinity] += 1
        try:
            known = self._intervals.get(affinity)
            if known is None:
                await self._create(affinity, wanted)
                self._intervals[affinity] = wanted
            elif wanted < known or self._added[affinity] >= self.batcher.config.batch_size:
                self._intervals[affinity] = min(known, wanted)
                self._added[affinity] = 0
                await self._run_soon(affinity)
        except ParleyError as exc:
            # The section is stored: a later section (or the task, once created) drains it.
            log.warning("batcher drain not scheduled", affinity=affinity, code=exc.code)

    async def _create(self, affinity: str, interval_ms: int) -> None:
        spec = scheduler_pb2.TaskSpec(
            id=str(drain_task_id(affinity)),
            agent_id=str(GATEWAY_AGENT),
            name=BATCHER_DRAIN,
            description=f"drain the prompt batcher's {affinity} sections",
            tags=["queue", "repeat"],
            metadata=scheduler_pb2.TaskMetadata(
                update_interval_ms=interval_ms, base_interval_ms=interval_ms, max_failures=0
            ),
        )
        spec.metadata.values.update({"affinity": affinity})
        set_now(spec.due_at)  # the first drain now; the task keeps the cadence after it
        try:
            await self.scheduler.CreateTask(scheduler_pb2.CreateTaskRequest(task=spec))
        except Conflict:
            await self._run_soon(affinity)  # created by another replica (or an earlier start)

    async def _run_soon(self, affinity: str) -> None:
        await self.scheduler.ResumeTask(
            scheduler_pb2.ResumeTaskRequest(
                id=str(drain_task_id(affinity)), agent_id=str(GATEWAY_AGENT), run_immediately=True
            )
        )


class DrainTimer:
    """Drains every affinity with pending sections on its interval (early once BATCH_SIZE are waiting)."""

    def __init__(self, batcher: Batcher, tick_seconds: float) -> None:
        self.batcher = batcher
        self.tick_seconds = tick_seconds
        self._task: asyncio.Task[None] | None = None
        self._drains: dict[str, asyncio.Task[Drained]] = {}

    async def start(self) -> None:
        self._task = asyncio.create_task(self._loop())

    async def _loop(self) -> None:
        while True:
            try:
                await self.tick()
            except ParleyError as exc:
                log.warning("drain timer tick failed", code=exc.code)
            await asyncio.sleep(self.tick_seconds)

    async def tick(self) -> None:
        config = self.batcher.config
        for status in await self.batcher.refresh_gauges():
            affinity = status.affinity
            if status.pending == 0 or affinity in self._drains or status.draining:
                continue
            interval = drain_interval_ms(config, status.min_cycle_ms)
            since = status.since_last_drain_ms
            if since is None or since >= interval or status.pending >= config.batch_size:
                task = asyncio.create_task(self.batcher.drain(affinity, wait=1.0))
                self._drains[affinity] = task
                task.add_done_callback(partial(self._finished, affinity))

    def _finished(self, affinity: str, task: asyncio.Task[Drained]) -> None:
        self._drains.pop(affinity, None)
        if not task.cancelled() and task.exception() is not None:
            error = task.exception()
            log.warning(
                "timed drain failed", affinity=affinity, code=getattr(error, "code", type(error).__name__)
            )

    async def stop(self, timeout: float) -> None:
        if self._task:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        running = list(self._drains.values())
        if running:
            await asyncio.wait(running, timeout=timeout)
