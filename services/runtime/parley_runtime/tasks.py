"""The runtime's own scheduled work, run by the scheduler through the worker library.

EMBED_BACKFILL: every agent has a repeating task that embeds the messages and facts stored
while the embedding model could not be reached (embeddings are made after the reply, so a
gateway outage leaves gaps that memory search would otherwise never see).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable, Sequence

from parley.v1 import scheduler_pb2
from parley.v1.scheduler_nats import SchedulerClient
from parley_platform.errors import Conflict, ParleyError
from parley_platform.logging import get_logger
from parley_platform.worker import Lease, Task, TaskResult, Workers

from .store import RuntimeStore

log = get_logger(__name__)

EMBED_BACKFILL = "RUNTIME_EMBED_BACKFILL"
BACKFILL_BATCH = 64
BACKFILL_INTERVAL_MS = 60_000
BUSY_INTERVAL_MS = 1_000


def task_id(agent_id: uuid.UUID) -> uuid.UUID:
    """One backfill task per agent, whichever replica creates it first."""
    return uuid.uuid5(agent_id, f"task:{EMBED_BACKFILL}")


def runtime_workers(
    store: RuntimeStore, embed: Callable[[Sequence[str], uuid.UUID], Awaitable[list[list[float]]]]
) -> Workers:
    workers = Workers()

    @workers.worker(EMBED_BACKFILL)
    async def backfill(task: Task, lease: Lease) -> TaskResult:
        agent_id = uuid.UUID(task.agent_id)
        missing = await store.missing_embeddings(agent_id, BACKFILL_BATCH)
        if missing:
            vectors = await embed([text for _, text in missing], agent_id)
            await store.set_embeddings(
                agent_id,
                [(memory_id, vector) for (memory_id, _), vector in zip(missing, vectors, strict=True)],
            )
        # A full batch means there may be more: come back soon; otherwise at the usual pace.
        return TaskResult(
            next_interval_ms=BUSY_INTERVAL_MS if len(missing) == BACKFILL_BATCH else BACKFILL_INTERVAL_MS
        )

    return workers


async def ensure_tasks(
    scheduler: SchedulerClient, agent_ids: Sequence[uuid.UUID], *, retry_seconds: float = 10.0
) -> None:
    """Create each agent's backfill task once; keep trying while the scheduler is not up yet."""
    pending = list(agent_ids)
    while pending:
        agent_id = pending[0]
        spec = scheduler_pb2.TaskSpec(
            id=str(task_id(agent_id)),
            agent_id=str(agent_id),
            name=EMBED_BACKFILL,
            description="embed messages and facts stored without an embedding",
            tags=["queue", "repeat"],
            metadata=scheduler_pb2.TaskMetadata(
                update_interval_ms=BACKFILL_INTERVAL_MS, base_interval_ms=BACKFILL_INTERVAL_MS, max_failures=0
            ),
        )
        try:
            await scheduler.CreateTask(scheduler_pb2.CreateTaskRequest(task=spec))
        except Conflict:
            pass  # another replica, or an earlier start, created it
        except ParleyError as exc:
            log.info(
                "runtime task not created yet", task=EMBED_BACKFILL, agent_id=str(agent_id), error=exc.code
            )
            await asyncio.sleep(retry_seconds)
            continue
        pending.pop(0)
