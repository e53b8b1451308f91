"""The scheduler's storage: named queries over the ``scheduler`` schema, rows to domain types."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg
from psycopg.types.json import Jsonb

from parley_platform.postgres import Database, Row, load_queries, translate

from .domain import (
    Completion,
    Lease,
    MissedRun,
    NewTask,
    PauseReason,
    Schedule,
    Status,
    Task,
    TaskEdit,
    TaskState,
    UncertainAttempt,
)
from .rules import first_run, ready_at

SQL_DIR = Path(__file__).parent / "sql"
MIGRATIONS_DIR = SQL_DIR / "migrations"
SCHEMA = "scheduler"
NOTIFY_CHANNEL = "scheduler_task_ready"
Q = load_queries(SQL_DIR / "queries.sql")


def schedule_from_row(row: Row) -> Schedule:
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


def lease_from_row(row: Row) -> Lease | None:
    expires: datetime | None = row["lease_expires_at"]
    return None if expires is None else Lease(row["lease_owner"], row["lease_token"], expires)


def task_from_row(row: Row) -> Task:
    """A task row (``RETURNING *`` or ``SELECT t.*``), with ``db_now`` and ``live_runs`` when selected."""
    return Task(
        id=row["id"],
        agent_id=row["agent_id"],
        name=row["name"],
        description=row["description"],
        tags=tuple(row["tags"]),
        room_id=row["room_id"],
        world_id=row["world_id"],
        entity_id=row["entity_id"],
        due_at=row["due_at"],
        schedule=schedule_from_row(row),
        values=row["values"],
        status=Status(row["status"]),
        pause_reason=None if row["pause_reason"] is None else PauseReason(row["pause_reason"]),
        failure_count=row["failure_count"],
        last_error=row["last_error"],
        last_run_at=row["last_run_at"],
        run_count=row["run_count"],
        next_run_at=row["next_run_at"],
        ready_at=row["ready_at"],
        orphaned_no_worker=row["orphaned_no_worker"],
        attempt=row["attempt"],
        lease=lease_from_row(row),
        revision=row["revision"],
        created_at=row["created_at"],
        updated_at=row["updated_at"],
        read_at=row.get("db_now"),
        live_runs=row.get("live_runs") or 0,
    )


def uncertain_from_row(row: Row) -> UncertainAttempt:
    return UncertainAttempt(
        attempt=row["attempt"],
        owner=row["owner"],
        claimed_at=row["claimed_at"],
        expired_at=row["expired_at"],
        reclaimed_at=row["reclaimed_at"],
    )


@dataclass(slots=True)
class Claimed:
    """A run this replica holds the lease of: the task's own lease (a blocking task, a one-shot), or
    the lease of one of a non-blocking task's runs (``concurrent``), whose ``slot`` it runs.

    ``task`` carries the run's lease and attempt, which is what its worker is sent; ``state`` is what
    the rules need of it, its ``next_run_at`` the run's own slot."""

    task: Task
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

    @property
    def lease(self) -> Lease:
        assert self.task.lease is not None, "a claimed run is leased"
        return self.task.lease

    def now(self) -> datetime:
        """The database's clock now, estimated from its time at the claim."""
        return self.db_now + timedelta(seconds=time.monotonic() - self.received)


def claimed_from_row(row: Row) -> Claimed:
    """A row of ``claim_due`` or ``claim_one``: the task, and the run's lease when it has its own."""
    task = task_from_row(row)
    concurrent = row["run_token"] is not None
    if concurrent:
        # The run's lease stands for the task's in what the worker is sent.
        run_lease = Lease(row["run_owner"], row["run_token"], row["run_expires_at"])
        task = replace(task, lease=run_lease, attempt=row["run_attempt"])
    db_now: datetime = row["db_now"]
    state = task.state
    slot: datetime | None = row["run_slot"]
    if slot is not None:
        # The rules of this run (is it overdue? which slot follows?) are about its own slot.
        state = replace(state, next_run_at=slot)
    assert task.lease is not None
    return Claimed(
        task=task,
        state=state,
        token=task.lease.token,
        attempt=task.attempt,
        db_now=db_now,
        reclaimed=row["old_expires_at"] is not None,
        due=row["old_ready_at"] or slot or db_now,
        concurrent=concurrent,
        slot=slot,
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


def edit_params(edit: TaskEdit) -> dict[str, Any]:
    """The parameters of ``update_task``."""
    s = edit.schedule
    return {
        "id": edit.id,
        "revision": edit.revision,
        "description": edit.description,
        "tags": list(edit.tags),
        "room_id": edit.room_id,
        "world_id": edit.world_id,
        "entity_id": edit.entity_id,
        "due_at": edit.due_at,
        "scheduled_at": s.scheduled_at,
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
        "values": Jsonb(edit.values),
        "next_run_at": edit.next_run_at,
        "ready_at": edit.ready_at,
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


async def due_hints(database_url: str) -> AsyncIterator[None]:
    """The trigger's hints that a queue task became due: one as soon as it listens (anything may have
    become due before), then one per NOTIFY. Ends when the connection drops, with its error.

    A connection of its own, outside the pool: it is held as long as the replica runs."""
    try:
        async with await psycopg.AsyncConnection.connect(
            database_url, autocommit=True, application_name="scheduler-listen"
        ) as conn:
            await conn.execute(f"LISTEN {NOTIFY_CHANNEL}")
            yield
            async for _ in conn.notifies():
                yield
    except psycopg.Error as exc:
        raise translate(exc, "listen for due tasks") from exc


class SchedulerStore:
    def __init__(self, db: Database) -> None:
        self.db = db

    async def insert(self, rows: list[dict[str, Any]]) -> list[Task]:
        inserted = await self.db.fetchall(Q["insert_tasks"], {"rows": Jsonb(rows)}, what="create tasks")
        return [task_from_row(row) for row in inserted]

    async def claim_due(self, owner: str, lease_ms: int, limit: int) -> list[Claimed]:
        rows = await self.db.fetchall(
            Q["claim_due"], {"owner": owner, "lease_ms": lease_ms, "limit": limit}, what="claim due tasks"
        )
        return [claimed_from_row(row) for row in rows]

    async def claim_one(
        self, task_id: uuid.UUID, agent_id: uuid.UUID | None, owner: str, lease_ms: int
    ) -> Claimed | None:
        row = await self.db.fetchone(
            Q["claim_one"],
            {"id": task_id, "agent_id": agent_id, "owner": owner, "lease_ms": lease_ms},
            what="claim task",
        )
        return None if row is None else claimed_from_row(row)

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

    async def get(self, task_id: uuid.UUID, agent_id: uuid.UUID | None) -> Task | None:
        row = await self.db.fetchone(Q["get_task"], {"id": task_id, "agent_id": agent_id}, what="get task")
        return None if row is None else task_from_row(row)

    async def prune_uncertain(self, retention_ms: int, limit: int = 1000) -> int:
        """Delete up to ``limit`` uncertain attempts older than the retention; how many went."""
        rows = await self.db.fetchall(
            Q["prune_uncertain"],
            {"retention_ms": retention_ms, "limit": limit},
            what="prune uncertain attempts",
        )
        return len(rows)

    async def uncertain_attempts(
        self, task_id: uuid.UUID, agent_id: uuid.UUID | None
    ) -> list[UncertainAttempt]:
        rows = await self.db.fetchall(
            Q["uncertain_attempts"], {"id": task_id, "agent_id": agent_id}, what="uncertain attempts"
        )
        return [uncertain_from_row(row) for row in rows]

    async def list_tasks(
        self,
        *,
        agent_id: uuid.UUID | None,
        tags: list[str],
        status: Status | None,
        name: str | None,
        limit: int,
        offset: int,
    ) -> list[Task]:
        rows = await self.db.fetchall(
            Q["list_tasks"],
            {
                "agent_id": agent_id,
                "tags": tags,
                "status": status.value if status else None,
                "name": name,
                "limit": limit,
                "offset": offset,
            },
            what="list tasks",
            prepare=False,
        )
        return [task_from_row(row) for row in rows]

    async def update(self, edit: TaskEdit) -> Task | None:
        """The task after the edit; None when its revision moved on since ``edit.revision``."""
        return await self._one("update_task", edit_params(edit), "update task")

    async def delete(self, task_id: uuid.UUID, agent_id: uuid.UUID | None) -> Task | None:
        return await self._one("delete_task", {"id": task_id, "agent_id": agent_id}, "delete task")

    async def pause(self, task_id: uuid.UUID, agent_id: uuid.UUID | None) -> Task | None:
        return await self._one("pause_task", {"id": task_id, "agent_id": agent_id}, "pause task")

    async def resume(self, task_id: uuid.UUID, agent_id: uuid.UUID | None, *, now: bool) -> Task | None:
        return await self._one(
            "resume_task", {"id": task_id, "agent_id": agent_id, "now": now}, "resume task"
        )

    async def run_soon(self, task_id: uuid.UUID, agent_id: uuid.UUID | None) -> Task | None:
        return await self._one("run_soon", {"id": task_id, "agent_id": agent_id}, "run task soon")

    async def _one(self, query: str, params: dict[str, Any], what: str) -> Task | None:
        row = await self.db.fetchone(Q[query], params, what=what)
        return None if row is None else task_from_row(row)

    async def orphaned_names(self) -> list[str]:
        return [row["name"] for row in await self.db.fetchall(Q["orphaned_names"], what="orphaned names")]

    async def resume_orphans(self, name: str) -> int:
        return len(await self.db.fetchall(Q["resume_orphans"], {"name": name}, what="resume orphans"))

    async def register_worker(self, name: str, service: str) -> None:
        await self.db.execute(
            Q["register_worker"], {"name": name, "service": service}, what="register worker"
        )
