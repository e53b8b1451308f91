"""The runtime's own scheduled work through the scheduler and the worker library: every agent has
an embedding backfill task, and running it embeds what was stored without an embedding."""

from __future__ import annotations

import secrets
import uuid

import psycopg
import pytest
from psycopg.types.json import Jsonb

from parley.v1 import scheduler_pb2
from parley_platform.errors import NotFound
from parley_platform.rpc import RpcClient
from parley_platform.testing import eventually
from support import DEFAULT_AGENT_ID, SessionEnv, Suite


async def test_the_embedding_backfill_task_exists_per_agent_and_fills_gaps(
    test_env: SessionEnv, tmp_path_factory: pytest.TempPathFactory
) -> None:
    suite = Suite(test_env, tmp_path_factory.mktemp("tasks"), f"k{secrets.token_hex(4)}")
    try:
        await suite.start(runtimes=0)
        await suite.add_service("parley_scheduler", "SCHEDULER")
        await suite.add_runtime()
        bus = await suite.connect()
        rpc = RpcClient(bus)
        task_id = str(uuid.uuid5(uuid.UUID(DEFAULT_AGENT_ID), "task:RUNTIME_EMBED_BACKFILL"))

        async def created() -> scheduler_pb2.Task | None:
            try:
                reply = await rpc.call(
                    "scheduler",
                    "GetTask",
                    scheduler_pb2.GetTaskRequest(id=task_id, agent_id=DEFAULT_AGENT_ID),
                    scheduler_pb2.GetTaskResponse,
                    timeout=5,
                )
            except NotFound:
                return None
            return reply.task if reply.HasField("task") else None

        task = await eventually(created, timeout=30, what="the runtime's backfill task")
        assert task.name == "RUNTIME_EMBED_BACKFILL"
        assert set(task.tags) >= {"queue", "repeat"}

        fact_id = uuid.uuid4()
        with psycopg.connect(suite.env.database_url, autocommit=True) as conn:
            conn.execute(
                "INSERT INTO runtime.memory (agent_id, id, kind, content) VALUES (%s, %s, 'facts', %s)",
                (DEFAULT_AGENT_ID, fact_id, Jsonb({"text": "Bo plays the cello"})),
            )
        run = await rpc.call(
            "scheduler",
            "ExecuteTask",
            scheduler_pb2.ExecuteTaskRequest(id=task_id, agent_id=DEFAULT_AGENT_ID),
            scheduler_pb2.ExecuteTaskResponse,
            timeout=30,
        )
        assert run.run.outcome == scheduler_pb2.TASK_OUTCOME_SUCCEEDED, run

        with psycopg.connect(suite.env.database_url) as conn:
            [(dims,)] = conn.execute(
                "SELECT vector_dims(embedding) FROM runtime.memory WHERE agent_id = %s AND id = %s",
                (DEFAULT_AGENT_ID, fact_id),
            ).fetchall()
        assert dims == 384
        await bus.close()
    finally:
        suite.stop()
