"""When the prompt batcher drains: the scheduler's job, through one repeating BATCHER_DRAIN task
per affinity (spec: model gateway, "Prompt batcher").

The first section of an affinity that a gateway replica sees creates the affinity's task (an id
derived from the affinity, so every replica names the same task and the scheduler keeps one).
Each run drains the affinity and answers the interval until the next: the shortest
``min_cycle_ms`` of its recurring sections, capped by ``MAX_DRAIN_INTERVAL_MS`` (adaptive
``next_interval``). A run is asked for at once, through the scheduler, when ``BATCH_SIZE``
sections were added since the last drain here, or when a recurring section wants a shorter
cycle than the task has. The batcher owns how a drain happens; this module only says when.
``PARLEY_BATCHER_SELF_DRAIN=true`` drains on a timer in the gateway instead (no scheduler).
"""

from __future__ import annotations

import uuid
from collections import Counter

from parley.v1 import scheduler_pb2
from parley_platform.errors import Conflict, ParleyError
from parley_platform.logging import get_logger
from parley_platform.rpc import RpcClient
from parley_platform.worker import Lease, Task, TaskResult, Workers

from .batcher import Batcher, drain_interval_ms
from .batching import Section

log = get_logger(__name__)

BATCHER_DRAIN = "BATCHER_DRAIN"
# Tasks belong to an agent; the batcher's belong to the gateway itself.
GATEWAY_AGENT = uuid.uuid5(uuid.NAMESPACE_URL, "parley:model-gateway")
SCHEDULER_TIMEOUT_SECONDS = 5.0
DRAIN_WAIT_SECONDS = 30.0


def drain_task_id(affinity: str) -> uuid.UUID:
    return uuid.uuid5(GATEWAY_AGENT, f"task:{BATCHER_DRAIN}:{affinity}")


class ScheduledDrains:
    def __init__(self, batcher: Batcher, rpc: RpcClient) -> None:
        self.batcher = batcher
        self.rpc = rpc
        self._intervals: dict[str, int] = {}  # affinities whose task exists, and its interval
        self._added: Counter[str] = Counter()  # sections added here since this replica's last drain

    def workers(self) -> Workers:
        workers = Workers()

        @workers.worker(BATCHER_DRAIN)
        async def drain(task: Task, lease: Lease) -> TaskResult:
            affinity = str(task.values.get("affinity") or "")
            if not affinity:
                raise ValueError("a BATCHER_DRAIN task needs values.affinity")
            self._added[affinity] = 0
            await self.batcher.drain(affinity, wait=DRAIN_WAIT_SECONDS)
            interval = await self.interval(affinity)
            self._intervals[affinity] = interval
            return TaskResult(next_interval_ms=interval)

        return workers

    async def interval(self, affinity: str) -> int:
        """The affinity's drain interval from the sections registered now."""
        shortest = None
        for row in await self.batcher.store.batcher_status(affinity):
            shortest = row["min_cycle_ms"]
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
        spec.due_at.GetCurrentTime()  # the first drain now; the task keeps the cadence after it
        try:
            await self.rpc.call(
                "scheduler",
                "CreateTask",
                scheduler_pb2.CreateTaskRequest(task=spec),
                scheduler_pb2.CreateTaskResponse,
                timeout=SCHEDULER_TIMEOUT_SECONDS,
            )
        except Conflict:
            await self._run_soon(affinity)  # created by another replica (or an earlier start)

    async def _run_soon(self, affinity: str) -> None:
        await self.rpc.call(
            "scheduler",
            "ResumeTask",
            scheduler_pb2.ResumeTaskRequest(
                id=str(drain_task_id(affinity)), agent_id=str(GATEWAY_AGENT), run_immediately=True
            ),
            scheduler_pb2.ResumeTaskResponse,
            timeout=SCHEDULER_TIMEOUT_SECONDS,
        )
