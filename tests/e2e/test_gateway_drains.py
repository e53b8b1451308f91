"""The prompt batcher drained by the scheduler: a BATCHER_DRAIN task per affinity, run by the
gateway's worker, as real processes (a scheduler, a gateway without its own drain timer)."""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import AsyncIterator

import pytest

from parley.v1 import model_pb2, scheduler_pb2
from parley_clients.batcher import BatcherClient
from parley_gateway.drains import GATEWAY_AGENT
from parley_platform.bus import Bus
from parley_platform.rpc import RpcClient
from parley_platform.testing import eventually
from support import SessionEnv, Suite


@pytest.fixture(scope="module")
async def drains(
    test_env: SessionEnv, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[tuple[Suite, Bus]]:
    # A namespace of its own: no other gateway may answer these requests or take these runs.
    suite = Suite(test_env, tmp_path_factory.mktemp("drains"), f"d{secrets.token_hex(4)}")
    try:
        await suite.add_service("parley_scheduler", "SCHEDULER", PARLEY_SCHEDULER_POLL_INTERVAL_SECONDS="1")
        suite.gateway = suite.gateway_process(
            PARLEY_BATCHER_SELF_DRAIN="false",
            PROMPT_BATCHER_MAX_DRAIN_INTERVAL_MS="60000",  # only BATCH_SIZE or a short cycle drains sooner
            PROMPT_BATCHER_BATCH_SIZE="3",
        ).start()
        await suite.gateway.wait_ready()
        bus = await suite.connect()
        try:
            yield suite, bus
        finally:
            await bus.close()
    finally:
        suite.stop()


async def drain_tasks(bus: Bus) -> dict[str, scheduler_pb2.Task]:
    reply = await RpcClient(bus).call(
        "scheduler",
        "ListTasks",
        scheduler_pb2.ListTasksRequest(agent_id=str(GATEWAY_AGENT), name="BATCHER_DRAIN"),
        scheduler_pb2.ListTasksResponse,
        timeout=10,
    )
    return {task.metadata.values["affinity"]: task for task in reply.tasks}


async def test_batch_size_sections_are_drained_by_the_scheduler_at_once(drains: tuple[Suite, Bus]) -> None:
    """The affinity's first section creates its task and is drained at once; after that the
    interval is a minute, so two more sections wait, and the third (BATCH_SIZE 3) has the
    scheduler run the drain at once."""
    _, bus = drains
    client = BatcherClient(bus, "agent-batch", timeout=20)
    affinity = f"room:{secrets.token_hex(4)}"
    try:
        assert await client.ask_once("q0", "How does the user feel?", ["feeling"], affinity=affinity) == {
            "feeling": "scripted"
        }
        tasks = await drain_tasks(bus)
        assert tasks[affinity].name == "BATCHER_DRAIN"
        assert "repeat" in tasks[affinity].tags
        assert tasks[affinity].metadata.update_interval_ms == 60000

        waiting = [
            await client._register(client.section(f"q{n}", "Feel?", ["feeling"], affinity=affinity), None)
            for n in (1, 2)
        ]
        assert all(w is not None for w in waiting)
        done, _ = await asyncio.wait([w for w in waiting if w is not None], timeout=2)
        assert not done, "drained before BATCH_SIZE sections were waiting or the interval passed"

        started = time.monotonic()
        third = await client._register(client.section("q3", "Feel?", ["feeling"], affinity=affinity), None)
        assert third is not None
        results = await asyncio.wait_for(asyncio.gather(*waiting, third), 15)  # type: ignore[arg-type]
        took = time.monotonic() - started
    finally:
        await client.dispose()
    assert [dict(r.fields) for r in results] == [{"feeling": "scripted"}] * 3
    assert len({r.drain_seq for r in results}) == 1, "one drain answered the three"
    assert took < 10, took


async def test_a_recurring_section_sets_the_drain_cadence(drains: tuple[Suite, Bus]) -> None:
    _, bus = drains
    client = BatcherClient(bus, "agent-thinker", timeout=20)
    thoughts: list[model_pb2.SectionResult] = []
    try:
        assert await client.think("muse", "Think", ["idea"], on_result=thoughts.append, min_cycle_ms=300)

        async def three() -> bool:
            return len(thoughts) >= 3

        await eventually(three, timeout=20, what="three recurring drains driven by the scheduler")
    finally:
        await client.dispose()
    assert len({t.drain_seq for t in thoughts}) == len(thoughts)
    task = (await drain_tasks(bus))["autonomy"]
    assert task.metadata.update_interval_ms == 300
    assert task.run_count >= 3
