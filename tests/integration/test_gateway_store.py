"""The gateway's budgets and usage ledger against a real PostgreSQL: reservations raced by 64 clients
on separate connections never over-spend, commits and releases balance, windows roll over."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import psycopg
import pytest

from parley_gateway.records import UsageIncrement
from parley_gateway.store import MIGRATIONS_DIR, SCHEMA, GatewayStore
from parley_platform.postgres import Database, migrate


@pytest.fixture
async def store(fresh_database: str) -> AsyncIterator[GatewayStore]:
    await migrate(fresh_database, SCHEMA, MIGRATIONS_DIR)
    db = Database(fresh_database, name="store", min_size=1, max_size=4)
    await db.open()
    try:
        yield GatewayStore(db)
    finally:
        await db.close()


@pytest.fixture
async def stores(fresh_database: str, store: GatewayStore) -> AsyncIterator[list[GatewayStore]]:
    """64 stores, each on a connection of its own, like 64 callers on different replicas."""
    databases = [Database(fresh_database, name=f"racer-{i}", min_size=1, max_size=1) for i in range(64)]
    await asyncio.gather(*(db.open() for db in databases))
    try:
        yield [GatewayStore(db) for db in databases]
    finally:
        await asyncio.gather(*(db.close() for db in databases))


async def race_reserve(stores: list[GatewayStore], agent: str, tokens: int) -> list[bool]:
    gate = asyncio.Event()

    async def one(store: GatewayStore) -> bool:
        await gate.wait()
        return (await store.reserve(agent, tokens)).admitted

    racers = [asyncio.create_task(one(s)) for s in stores]
    gate.set()
    return await asyncio.gather(*racers)


async def test_64_concurrent_reservations_never_overspend(stores: list[GatewayStore]) -> None:
    agent = "race-agent"
    await stores[0].set_budget(agent, 1000, 3600)

    admitted = await race_reserve(stores, agent, 50)
    assert admitted.count(True) == 20
    budget = await stores[0].get_budget(agent)
    assert budget is not None
    assert (budget.reserved_tokens, budget.spent_tokens) == (1000, 0)

    winners = [s for s, won in zip(stores, admitted, strict=True) if won]
    committed = await asyncio.gather(*(s.commit(agent, 50, 30) for s in winners))
    assert all(committed)
    budget = await stores[0].get_budget(agent)
    assert budget is not None
    assert (budget.reserved_tokens, budget.spent_tokens) == (0, 600)

    again = await race_reserve(stores, agent, 50)
    assert again.count(True) == 8  # (1000 - 600) // 50
    winners = [s for s, won in zip(stores, again, strict=True) if won]
    released = await asyncio.gather(*(s.release(agent, 50) for s in winners))
    assert all(released)
    budget = await stores[0].get_budget(agent)
    assert budget is not None
    assert (budget.reserved_tokens, budget.spent_tokens) == (0, 600)


async def test_an_agent_without_a_budget_is_not_limited(store: GatewayStore) -> None:
    reservation = await store.reserve("free-agent", 10**9)
    assert (reservation.budgeted, reservation.admitted) == (False, False)
    assert await store.commit("free-agent", 10, 10) is False


async def test_a_call_larger_than_the_budget_is_refused(store: GatewayStore) -> None:
    await store.set_budget("small", 100, 60)
    reservation = await store.reserve("small", 101)
    assert (reservation.budgeted, reservation.admitted, reservation.limit_tokens) == (True, False, 100)


async def test_the_window_rolls_over(store: GatewayStore, fresh_database: str) -> None:
    await store.set_budget("roller", 100, 60)
    assert (await store.reserve("roller", 80)).admitted
    assert await store.commit("roller", 80, 80)
    assert not (await store.reserve("roller", 30)).admitted
    async with await psycopg.AsyncConnection.connect(fresh_database, autocommit=True) as conn:
        # The window began two minutes ago: it is over.
        await conn.execute(
            "UPDATE model.budget SET window_started_at = now() - interval '2 minutes'"
            " WHERE agent_id = 'roller'"
        )
    budget = await store.get_budget("roller")
    assert budget is not None
    assert budget.spent_tokens == 0
    assert (await store.reserve("roller", 30)).admitted
    budget = await store.get_budget("roller")
    assert budget is not None
    assert (budget.spent_tokens, budget.reserved_tokens) == (0, 30)


async def test_a_release_never_drives_the_reservation_negative(store: GatewayStore) -> None:
    await store.set_budget("careful", 100, 60)
    assert (await store.reserve("careful", 40)).admitted
    assert await store.release("careful", 40)
    assert await store.release("careful", 40) is False
    assert await store.commit("careful", 40, 40) is False


async def test_ledger_increments_from_many_flushes_add_up(stores: list[GatewayStore]) -> None:
    row = UsageIncrement("ledger-agent", "scripted", "scripted-v1", "TEXT_SMALL", "generate", 1, 10, 5, 2)
    await asyncio.gather(*(s.record_usage([row]) for s in stores[:32]))
    [total] = await stores[0].list_usage("ledger-agent", 10, 0)
    assert (
        total.requests,
        total.input_tokens,
        total.output_tokens,
        total.cached_input_tokens,
    ) == (
        32,
        320,
        160,
        64,
    )
    assert await stores[0].list_usage("nobody", 10, 0) == []
