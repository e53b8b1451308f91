"""The scheduler's storage: named queries over the ``scheduler`` schema, rows to domain types."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from psycopg.types.json import Jsonb

from parley_platform.postgres import Database, Row, load_queries

from .domain import Completion, MissedRun, NewTask, Schedule, TaskState, first_run, ready_at

SQL_DIR = Path(__file__).parent / "sql"
MIGRATIONS_DIR = SQL_DIR / "migrations"
SCHEMA = "scheduler"
NOTIFY_CHANNEL = "scheduler_task_ready"
Q = load_queries(SQL_DIR / "queries.sql")


def schedule_of(row: Row) -> Schedule:
    return Schedule(
        update_interval_ms=row["update_interval_ms"],
        base_interval_ms=row["base_interval_ms"],
        not_before_ms=row["not_before_ms"],
        not_after_ms=row["not_after_ms"],
        max_failures=row["max_failures"],
        max_attempts=row["max_attempts"],
        blocking=row["blocking"],
        missed_run=MissedRun(row["missed_run"]),
        cron=row["cron"],
        scheduled_at=row["scheduled_at"],
        timeout_ms=row["timeout_ms"],
    )


def state_of(row: Row) -> TaskState:
    return TaskState(
        id=row["id"],
        name=row["name"],
        repeat=row["repeat"],
        schedule=schedule_of(row),
        failure_count=row["failure_count"],
        last_error=row["last_error"],
        next_run_at=row["next_run_at"],
        last_run_at=row["last_run_at"],
        created_at=row["created_at"],
        revision=row["revision"],
    )


@dataclass(frozen=True)
class Claimed:
    """A run this replica holds the lease of: the task's own lease (a blocking task, a one-shot), or
    the lease of one of a non-blocking task's runs (``concurrent``), whose ``slot`` it runs."""

    row: Row
    state: TaskState
    token: int
    attempt: int
    db_now: datetime
    reclaimed: bool  # an earlier attempt's lease expired
    due: datetime  # when the run became due
    concurrent: bool = False
    slot: datetime | None = None  # a concurrent run's scheduled slot (None: ExecuteTask)
    received: float = field(default_factory=time.monotonic)

    @property
    def id(self) -> uuid.UUID:
        return self.state.id

    def now(self) -> datetime:
        """The database's clock now, estimated from its time at the claim."""
        return self.db_now + timedelta(seconds=time.monotonic() - self.received)


def _claimed(row: Row) -> Claimed:
    concurrent = row["run_token"] is not None
    if concurrent:
        # The run's lease stands for the task's in what the worker is sent.
        row = {
            **row,
            "lease_token": row["run_token"],
            "lease_owner": row["run_owner"],
            "lease_expires_at": row["run_expires_at"],
            "attempt": row["run_attempt"],
        }
    db_now: datetime = row["db_now"]
    state = state_of(row)
    if row["run_slot"] is not None:
        # The rules of this run (is it overdue? which slot follows?) are about its own slot.
        state = replace(state, next_run_at=row["run_slot"])
    return Claimed(
        row=row,
        state=state,
        token=row["lease_token"],
        attempt=row["attempt"],
        db_now=db_now,
        reclaimed=row["old_expires_at"] is not None,
        due=row["old_ready_at"] or row["run_slot"] or db_now,
        concurrent=concurrent,
        slot=row["run_slot"],
    )


def insert_row(task: NewTask, now: datetime) -> dict[str, Any]:
    s = task.schedule
    next_run = first_run(repeat=task.repeat, schedule=s, due_at=task.due_at, created_at=now)
    return {
        "id": str(task.id),
        "agent_id": str(task.agent_id),
        "name": task.name,
        "description": task.description,
        "tags": list(task.tags),
        "room_id": str(task.room_id) if task.room_id else None,
        "world_id": str(task.world_id) if task.world_id else None,
        "entity_id": str(task.entity_id) if task.entity_id else None,
        "due_at": task.due_at.isoformat() if task.due_at else None,
        "scheduled_at": s.scheduled_at.isoformat() if s.scheduled_at else None,
        "update_interval_ms": s.update_interval_ms,
        "base_interval_ms": s.base_interval_ms,
        "not_before_ms": s.not_before_ms,
        "not_after_ms": s.not_after_ms,
        "max_failures": s.max_failures,
        "max_attempts": s.max_attempts,
        "blocking": s.blocking,
        "missed_run": s.missed_run.value,
        "cron": s.cron,
        "timeout_ms": s.timeout_ms,
        "values": task.values,
        "next_run_at": next_run.isoformat(),
        "ready_at": ready_at(next_run, s, repeat=task.repeat).isoformat(),
    }


def completion_row(claimed: Claimed, completion: Completion) -> dict[str, Any]:
    return {
        "id": str(claimed.id),
        "token": claimed.token,
        "revision": claimed.state.revision,
        "status": completion.status.value,
        "pause_reason": completion.pause_reason.value if completion.pause_reason else None,
        "failure_count": completion.failure_count,
        "last_error": completion.last_error,
        "update_interval_ms": completion.update_interval_ms,
        "base_interval_ms": completion.base_interval_ms,
        "next_at": completion.next_at.isoformat() if completion.next_at else None,
        "delay_ms": completion.delay_ms,
        "not_before_ms": completion.not_before_ms,
        "ran": completion.ran,
        "orphaned": completion.orphaned,
        "keep_schedule": completion.keep_schedule,
    }


def run_completion_row(claimed: Claimed, state: TaskState, completion: Completion) -> dict[str, Any]:
    """The parameters of ``finish_run``: the completion of a concurrent run, computed from ``state``."""
    return {
        **completion_row(claimed, completion),
        "revision": state.revision,
        "failure_count_was": state.failure_count,
    }


class SchedulerStore:
    def __init__(self, db: Database) -> None:
        self.db = db

    async def insert(self, rows: list[dict[str, Any]]) -> list[Row]:
        return await self.db.fetchall(Q["insert_tasks"], {"rows": Jsonb(rows)}, what="create tasks")

    async def claim_due(self, owner: str, lease_ms: int, limit: int) -> list[Claimed]:
        rows = await self.db.fetchall(
            Q["claim_due"], {"owner": owner, "lease_ms": lease_ms, "limit": limit}, what="claim due tasks"
        )
        return [_claimed(row) for row in rows]

    async def claim_one(
        self, task_id: uuid.UUID, agent_id: uuid.UUID | None, owner: str, lease_ms: int
    ) -> Claimed | None:
        row = await self.db.fetchone(
            Q["claim_one"],
            {"id": task_id, "agent_id": agent_id, "owner": owner, "lease_ms": lease_ms},
            what="claim task",
        )
        return None if row is None else _claimed(row)

    async def finish(
        self, deletes: list[tuple[uuid.UUID, int]], updates: list[dict[str, Any]]
    ) -> dict[str, bool]:
        """Apply a batch of completions; returns {task id: deleted} for those whose lease still held."""
        rows = await self.db.fetchall(
            Q["finish_runs"],
            {
                "delete_ids": [task_id for task_id, _ in deletes],
                "delete_tokens": [token for _, token in deletes],
                "rows": Jsonb(updates),
            },
            what="finish runs",
        )
        return {str(row["id"]): row["deleted"] for row in rows}

    async def advance_slot(
        self, task_id: uuid.UUID, slot: datetime, next_run_at: datetime, ready: datetime
    ) -> bool:
        """Make a non-blocking task claimable again at its next slot; False if it moved meanwhile."""
        row = await self.db.fetchone(
            Q["advance_slot"],
            {"id": task_id, "slot": slot, "next_run_at": next_run_at, "ready_at": ready},
            what="advance slot",
        )
        return row is not None

    async def finish_run(self, params: dict[str, Any]) -> tuple[bool, bool]:
        """Complete one concurrent run: (applied, held). Held but not applied: the task changed since
        the outcome was computed; compute it again. Not held: the run's lease was lost."""
        row = await self.db.fetchone(Q["finish_run"], params, what="finish run")
        assert row is not None
        return bool(row["applied"]), bool(row["held"])

    async def extend_lease(self, task_id: uuid.UUID, token: int, lease_ms: int) -> datetime | None:
        row = await self.db.fetchone(
            Q["extend_lease"], {"id": task_id, "token": token, "lease_ms": lease_ms}, what="extend lease"
        )
        return None if row is None else row["lease_expires_at"]

    async def release_lease(self, task_id: uuid.UUID, token: int, error: str) -> bool:
        row = await self.db.fetchone(
            Q["release_lease"], {"id": task_id, "token": token, "error": error}, what="release lease"
        )
        return row is not None

    async def next_wakeup(self) -> tuple[datetime | None, datetime]:
        row = await self.db.fetchone(Q["next_wakeup"], what="next wake-up")
        assert row is not None
        return row["at"], row["db_now"]

    async def count_due(self) -> int:
        row = await self.db.fetchone(Q["count_due"], what="count due tasks")
        assert row is not None
        return int(row["due"])

    async def get(self, task_id: uuid.UUID, agent_id: uuid.UUID | None) -> Row | None:
        return await self.db.fetchone(Q["get_task"], {"id": task_id, "agent_id": agent_id}, what="get task")

    async def prune_uncertain(self, retention_ms: int, limit: int = 1000) -> int:
        """Delete up to ``limit`` uncertain attempts older than the retention; how many went."""
        rows = await self.db.fetchall(
            Q["prune_uncertain"],
            {"retention_ms": retention_ms, "limit": limit},
            what="prune uncertain attempts",
        )
        return len(rows)

    async def uncertain_attempts(self, task_id: uuid.UUID, agent_id: uuid.UUID | None) -> list[Row]:
        return await self.db.fetchall(
            Q["uncertain_attempts"], {"id": task_id, "agent_id": agent_id}, what="uncertain attempts"
        )

    async def list_tasks(
        self,
        *,
        agent_id: uuid.UUID | None,
        tags: list[str],
        status: str | None,
        name: str | None,
        limit: int,
        offset: int,
    ) -> list[Row]:
        return await self.db.fetchall(
            Q["list_tasks"],
            {
                "agent_id": agent_id,
                "tags": tags,
                "status": status,
                "name": name,
                "limit": limit,
                "offset": offset,
            },
            what="list tasks",
        )

    async def update(self, params: dict[str, Any]) -> Row | None:
        return await self.db.fetchone(Q["update_task"], params, what="update task")

    async def delete(self, task_id: uuid.UUID, agent_id: uuid.UUID | None) -> Row | None:
        return await self.db.fetchone(
            Q["delete_task"], {"id": task_id, "agent_id": agent_id}, what="delete task"
        )

    async def pause(self, task_id: uuid.UUID, agent_id: uuid.UUID | None) -> Row | None:
        return await self.db.fetchone(
            Q["pause_task"], {"id": task_id, "agent_id": agent_id}, what="pause task"
        )

    async def resume(self, task_id: uuid.UUID, agent_id: uuid.UUID | None, *, now: bool) -> Row | None:
        return await self.db.fetchone(
            Q["resume_task"], {"id": task_id, "agent_id": agent_id, "now": now}, what="resume task"
        )

    async def run_soon(self, task_id: uuid.UUID, agent_id: uuid.UUID | None) -> Row | None:
        return await self.db.fetchone(
            Q["run_soon"], {"id": task_id, "agent_id": agent_id}, what="run task soon"
        )

    async def orphaned_names(self) -> list[str]:
        return [row["name"] for row in await self.db.fetchall(Q["orphaned_names"], what="orphaned names")]

    async def resume_orphans(self, name: str) -> int:
        return len(await self.db.fetchall(Q["resume_orphans"], {"name": name}, what="resume orphans"))

    async def register_worker(self, name: str, service: str) -> None:
        await self.db.execute(
            Q["register_worker"], {"name": name, "service": service}, what="register worker"
        )
