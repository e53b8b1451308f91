"""The scheduler's statements against a real Postgres: claims, leases, completions and the wake-up
trigger, each raced by many real connections with the winners counted."""

from __future__ import annotations

import asyncio
import uuid
from collections import Counter
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta

import psycopg
import pytest
from racing import Span, assert_raced, timed

from parley_platform.postgres import Database, migrate
from parley_platform.testing import eventually
from parley_scheduler import domain, rules
from parley_scheduler.store import (
    MIGRATIONS_DIR,
    NOTIFY_CHANNEL,
    SCHEMA,
    Q,
    SchedulerStore,
    completion_row,
    insert_row,
)
from support import explain, plan_nodes, prepared_statements

AGENT = str(uuid.uuid4())


@pytest.fixture
async def database(fresh_database: str) -> str:
    await migrate(fresh_database, SCHEMA, MIGRATIONS_DIR)
    return fresh_database


@pytest.fixture
async def store(database: str) -> AsyncIterator[SchedulerStore]:
    db = Database(database, name="test", min_size=1, max_size=4)
    await db.open()
    yield SchedulerStore(db)
    await db.close()


def one_shot(**meta: object) -> domain.NewTask:
    return domain.new_task(
        id="",
        agent_id=AGENT,
        name="WORK",
        description="",
        tags=["queue"],
        room_id="",
        world_id="",
        entity_id="",
        due_at=None,
        metadata=domain.MetadataInput(**meta),  # type: ignore[arg-type]
        values={"n": 1},
    )


def repeat(interval_ms: float = 1000, **meta: object) -> domain.NewTask:
    return domain.new_task(
        id="",
        agent_id=AGENT,
        name="TICK",
        description="",
        tags=["queue", "repeat"],
        room_id="",
        world_id="",
        entity_id="",
        due_at=datetime.now(UTC) - timedelta(milliseconds=1),
        metadata=domain.MetadataInput(update_interval_ms=interval_ms, **meta),  # type: ignore[arg-type]
        values={},
    )


async def insert(store: SchedulerStore, tasks: list[domain.NewTask]) -> list[uuid.UUID]:
    now = datetime.now(UTC) - timedelta(milliseconds=5)
    created = await store.insert([insert_row(task, now) for task in tasks])
    return [task.id for task in created]


async def test_racing_claimers_take_each_due_task_exactly_once(database: str, store: SchedulerStore) -> None:
    ids = []
    for _ in range(4):
        ids += await insert(store, [one_shot() for _ in range(500)])
    claimers = 8
    ready = asyncio.Barrier(claimers)
    first_claims: list[Span] = []

    async def claimer(index: int) -> list[uuid.UUID]:
        db = Database(database, name=f"claimer-{index}", min_size=1, max_size=1)
        await db.open()
        mine: list[uuid.UUID] = []
        try:
            racing = SchedulerStore(db)
            await ready.wait()  # every claimer connected: the first claims start together
            batch, span = await timed(racing.claim_due(f"replica-{index}", 60_000, 16))
            first_claims.append(span)
            while batch:
                mine += [c.id for c in batch]
                assert all(c.attempt == 1 and not c.reclaimed for c in batch)
                batch = await racing.claim_due(f"replica-{index}", 60_000, 16)
        finally:
            await db.close()
        return mine

    results = await asyncio.gather(*(claimer(i) for i in range(claimers)))
    assert_raced(first_claims, "the first claims")
    claimed = Counter(task_id for result in results for task_id in result)
    assert set(claimed) == set(ids)
    assert set(claimed.values()) == {1}, "a task was claimed twice"
    assert sum(1 for r in results if r) > 1, "only one claimer ever won; the race did not happen"
    async with await psycopg.AsyncConnection.connect(database) as conn:
        cur = await conn.execute("SELECT count(*) FROM scheduler.task WHERE status = 'running'")
        assert await cur.fetchone() == (len(ids),)


async def test_an_expired_lease_is_claimed_again_as_the_next_attempt(store: SchedulerStore) -> None:
    [task_id] = await insert(store, [one_shot()])
    [first] = await store.claim_due("crashed", 300, 10)
    assert (first.attempt, first.reclaimed) == (1, False)
    assert await store.claim_due("other", 300, 10) == [], "a live lease must not be claimed"

    async def reclaimed() -> list[object]:
        return await store.claim_due("survivor", 60_000, 10)  # type: ignore[return-value]

    [second] = await eventually(reclaimed, timeout=5, what="the expired lease claimed again")
    assert second.id == task_id
    assert (second.attempt, second.reclaimed) == (2, True)
    assert second.token > first.token

    # The crashed attempt's late completion is rejected; the live one applies.
    done = rules.on_success(first.state, first.db_now, next_interval_ms=None, preserve=False)
    assert await store.finish([(first.id, first.token)], []) == {}
    assert await store.finish([(second.id, second.token)], []) == {str(task_id): True}
    assert done.delete
    [uncertain] = await store.uncertain_attempts(task_id, None)
    assert (uncertain.attempt, uncertain.owner) == (1, "crashed")


async def test_racing_completions_with_one_token_apply_once(database: str, store: SchedulerStore) -> None:
    [task_id] = await insert(store, [repeat(1000)])
    [claimed] = await store.claim_due("me", 60_000, 10)
    completion = rules.on_failure(claimed.state, claimed.db_now, error="boom", retry_at=None)
    row = completion_row(claimed, completion)
    completers = 12
    ready = asyncio.Barrier(completers)

    async def complete(index: int) -> tuple[dict[str, bool], Span]:
        db = Database(database, name=f"completer-{index}", min_size=1, max_size=1)
        await db.open()
        try:
            await ready.wait()
            return await timed(SchedulerStore(db).finish([], [row]))
        finally:
            await db.close()

    raced = await asyncio.gather(*(complete(i) for i in range(completers)))
    assert_raced((span for _, span in raced), "the completions")
    results = [result for result, _ in raced]
    assert sum(1 for r in results if r) == 1
    current = await store.get(task_id, None)
    assert current is not None
    assert (current.status, current.failure_count, current.last_error) == ("active", 1, "boom")
    assert current.schedule.update_interval_ms == 2000
    assert current.schedule.base_interval_ms == 1000
    assert current.lease is None


async def test_racing_executes_of_one_task_claim_it_once(database: str, store: SchedulerStore) -> None:
    [task_id] = await insert(store, [repeat(3_600_000)])
    executors = 16
    ready = asyncio.Barrier(executors)

    async def execute(index: int) -> tuple[bool, Span]:
        db = Database(database, name=f"exec-{index}", min_size=1, max_size=1)
        await db.open()
        try:
            await ready.wait()
            claimed, span = await timed(SchedulerStore(db).claim_one(task_id, None, f"api-{index}", 60_000))
            return claimed is not None, span
        finally:
            await db.close()

    raced = await asyncio.gather(*(execute(i) for i in range(executors)))
    assert_raced((span for _, span in raced), "the executes")
    results = [won for won, _ in raced]
    assert results.count(True) == 1


async def test_completion_applies_the_rules_and_respects_an_operator_pause(store: SchedulerStore) -> None:
    [task_id] = await insert(store, [repeat(1000)])
    [claimed] = await store.claim_due("me", 60_000, 10)
    paused = await store.pause(task_id, None)
    assert paused is not None
    assert paused.status == "paused"
    done = rules.on_success(claimed.state, claimed.db_now, next_interval_ms=500, preserve=False)
    assert await store.finish([], [completion_row(claimed, done)]) == {str(task_id): False}
    row = await store.get(task_id, None)
    assert row is not None
    # Still paused by the operator, and the schedule kept: the pause bumped the revision mid-run.
    assert (row.status, row.pause_reason, row.lease) == ("paused", "operator", None)
    assert row.schedule.update_interval_ms == 1000
    assert row.run_count == 1
    resumed = await store.resume(task_id, None, now=True)
    assert resumed is not None
    assert resumed.status == "active"
    assert [c.id for c in await store.claim_due("me", 60_000, 10)] == [task_id]


async def test_success_reschedules_from_the_database_clock(store: SchedulerStore) -> None:
    [task_id] = await insert(store, [repeat(1000)])
    [claimed] = await store.claim_due("me", 60_000, 10)
    done = rules.on_success(claimed.state, claimed.db_now, next_interval_ms=1500, preserve=False)
    await store.finish([], [completion_row(claimed, done)])
    row = await store.get(task_id, None)
    assert row is not None
    assert row.status == "active"
    assert row.schedule.update_interval_ms == 1500
    assert row.schedule.base_interval_ms is None
    gap = (row.next_run_at - row.last_run_at).total_seconds()
    assert 1.49 < gap < 1.6
    assert row.ready_at == row.next_run_at


async def test_heartbeat_extends_only_the_current_lease(store: SchedulerStore) -> None:
    [task_id] = await insert(store, [one_shot()])
    [claimed] = await store.claim_due("me", 1000, 10)
    extended = await store.extend_lease(task_id, claimed.token, 60_000)
    assert extended is not None
    assert extended > claimed.db_now + timedelta(seconds=30)
    assert await store.extend_lease(task_id, claimed.token + 1, 60_000) is None
    assert await store.release_lease(task_id, claimed.token, "attempt 1 uncertain")
    [again] = await store.claim_due("next", 60_000, 10)
    assert again.attempt == 2
    assert await store.extend_lease(task_id, claimed.token, 60_000) is None


async def test_the_trigger_notifies_when_a_queue_task_becomes_due(
    database: str, store: SchedulerStore
) -> None:
    async with await psycopg.AsyncConnection.connect(database, autocommit=True) as listener:
        await listener.execute(f"LISTEN {NOTIFY_CHANNEL}")
        await insert(store, [one_shot() for _ in range(200)])
        seen = [n async for n in listener.notifies(timeout=2, stop_after=1)]
        assert len(seen) == 1, "one insert statement notifies once"
        [claimed] = await store.claim_due("me", 60_000, 1)
        done = rules.on_failure(claimed.state, claimed.db_now, error="x", retry_at=None)
        # A failed one-shot is not due again: no notification for it.
        await store.finish([], [completion_row(claimed, done)])
        assert [n async for n in listener.notifies(timeout=0.3)] == []


async def test_constraints_refuse_impossible_states(database: str, store: SchedulerStore) -> None:
    [task_id] = await insert(store, [one_shot()])
    async with await psycopg.AsyncConnection.connect(database, autocommit=True) as conn:
        for bad in (
            "UPDATE scheduler.task SET status = 'running' WHERE id = %s",
            "UPDATE scheduler.task SET status = 'paused' WHERE id = %s",
            "UPDATE scheduler.task SET lease_owner = 'x' WHERE id = %s",
            "UPDATE scheduler.task SET cron = '* * * * *' WHERE id = %s",
            "UPDATE scheduler.task SET name = 'a.b' WHERE id = %s",
        ):
            with pytest.raises(psycopg.errors.CheckViolation):
                await conn.execute(bad, (task_id,))


async def test_uncertain_attempts_are_pruned_after_their_retention(
    store: SchedulerStore, database: str
) -> None:
    async with await psycopg.AsyncConnection.connect(database, autocommit=True) as conn:
        await conn.execute(
            "INSERT INTO scheduler.uncertain_attempt"
            " (task_id, attempt, agent_id, name, owner, lease_token, expired_at, reclaimed_at)"
            " SELECT gen_random_uuid(), 1, %s, 'OLD', 'replica', g, now(), now() - g * interval '1 hour'"
            "   FROM generate_series(1, 30) g",
            (AGENT,),
        )
    # 30 attempts reclaimed 1..30 hours ago; a retention of 10.5 hours keeps the 10 youngest.
    retention_ms = round(10.5 * 3600 * 1000)
    assert await store.prune_uncertain(retention_ms, limit=15) == 15  # oldest first, bounded
    assert await store.prune_uncertain(retention_ms, limit=15) == 5
    assert await store.prune_uncertain(retention_ms, limit=15) == 0
    async with await psycopg.AsyncConnection.connect(database) as conn:
        cur = await conn.execute(
            "SELECT min(now() - reclaimed_at), max(now() - reclaimed_at), count(*)"
            " FROM scheduler.uncertain_attempt"
        )
        youngest, oldest, kept = await cur.fetchone()  # type: ignore[misc]
    assert kept == 10
    assert timedelta(hours=0.9) < youngest
    assert oldest < timedelta(hours=10.1)


async def test_the_page_of_tasks_is_planned_for_its_filters(database: str) -> None:
    """``ListTasks``' filters are optional (``%(agent_id)s IS NULL OR agent_id = …``): the page runs
    unprepared, planned for the filters given, never as PostgreSQL's one generic plan (which cannot
    use the agent's index when the agent may be absent). ``get`` is prepared, so the count can move."""
    db = Database(database, name="one-connection", min_size=1, max_size=1)
    await db.open()
    try:
        store = SchedulerStore(db)
        [task_id] = await insert(store, [one_shot()])
        before = await prepared_statements(db)
        assert await store.get(task_id, None) is not None
        assert len(await prepared_statements(db)) == len(before) + 1
        for _ in range(7):
            for agent in (None, uuid.UUID(AGENT)):
                page = await store.list_tasks(
                    agent_id=agent, tags=[], status=None, name=None, limit=10, offset=0
                )
                assert [t.id for t in page] == [task_id]
        assert len(await prepared_statements(db)) == len(before) + 1
    finally:
        await db.close()


async def test_a_claim_reads_only_the_tasks_it_takes_whatever_the_plan(store: SchedulerStore) -> None:
    """The claim reaches its tasks by their keys in both of PostgreSQL's plans, its generic one included (a
    pooled connection's prepared statement switches to it after five executions). As joins, the
    generic plan, which cannot know that LIMIT is small, hashed the whole task table on every
    claim: 9.9 ms at 20,000 due tasks instead of 0.9 (EXPLAIN ANALYZE). Every path runs here:
    due one-shots, a blocking task's expired lease, a non-blocking task's slot and its lapsed run."""
    # First (due first): a blocking task and a non-blocking one, claimed with leases that expire.
    expiring = await insert(store, [one_shot(), repeat(blocking=False)])
    taken = await store.claim_due("crashed", 1, 10)
    assert {c.id for c in taken} == set(expiring)
    assert [c.concurrent for c in taken if c.id == expiring[1]] == [True]
    await insert(store, [one_shot() for _ in range(3000)])
    await store.db.execute("ANALYZE scheduler.task", {}, what="analyze")
    await store.db.execute("ANALYZE scheduler.run", {}, what="analyze")
    await asyncio.sleep(0.01)  # both leases (1 ms) have expired
    limit = 32
    values = {"owner": "replica", "lease_ms": 60_000, "limit": limit}
    for mode in ("force_custom_plan", "force_generic_plan"):
        # In a transaction rolled back: each mode claims the same rows.
        plan = await explain(store.db, Q["claim_due"], values, plan_cache_mode=mode)
        for node in plan_nodes(plan):
            if node.get("Relation Name") in ("task", "run"):
                seen = f"{mode}: {node['Node Type']} on {node['Alias']}, {node['Actual Rows']} rows"
                if node["Relation Name"] == "task":  # a run table of one row is read whole: fine
                    assert node["Node Type"] != "Seq Scan", seen
                # At most the due tasks and the expired ones a claim takes (a limit of each).
                assert node["Actual Rows"] <= 2 * limit, seen
        # 32 due tasks, the blocking task's expired lease and the non-blocking task's lapsed run.
        assert plan["Actual Rows"] == limit + 2, (mode, plan["Actual Rows"])
