"""The local model from a file the user names (PARLEY_LOCAL_MODEL_PATH), and the evaluated prompt
prefixes the gateway keeps on disk (PARLEY_LOCAL_PREFIX_CACHE_DIR): a restarted gateway loads the
prefix at start-up, so its first request does not evaluate the stable segments again; a damaged
prefix file is dropped, not trusted. Real gateway processes, SmolLM2 standing for any GGUF file."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from test_gateway import gateway
from test_gateway_local import turn

from parley.v1 import model_pb2
from parley_gateway.local import smollm_path
from parley_platform.bus import Bus
from parley_platform.rpc import RpcClient
from parley_platform.testing import ServiceProcess
from parley_runtime.parser import parse_response
from support import SessionEnv

pytestmark = pytest.mark.slow


@pytest.fixture
async def rpc(test_env: SessionEnv) -> AsyncIterator[RpcClient]:
    bus = await Bus.connect(test_env.nats_url, name="local-files", namespace=f"f{test_env.namespace}")
    try:
        yield RpcClient(bus)
    finally:
        await bus.close()


def local_gateway(test_env: SessionEnv, logs: Path, **extra: str) -> ServiceProcess:
    return gateway(
        test_env,
        logs,
        f"f{test_env.namespace}",
        PARLEY_MODEL_PROVIDER="local",
        PARLEY_EMBEDDING_PROVIDER="scripted",
        PARLEY_BATCHER_SELF_DRAIN="false",
        PARLEY_LOCAL_TEMPERATURE="0",
        **extra,
    )


async def ask(rpc: RpcClient, message: str) -> model_pb2.GenerateResponse:
    return await rpc.call("model", "Generate", turn(message, 48), model_pb2.GenerateResponse, timeout=120)


async def test_a_users_gguf_file_runs_and_its_prefix_survives_a_restart(
    test_env: SessionEnv, rpc: RpcClient, tmp_path: Path
) -> None:
    mine = tmp_path / "my-own-model.gguf"
    os.symlink(smollm_path(), mine)
    prefixes = tmp_path / "prefixes"
    settings = {"PARLEY_LOCAL_MODEL_PATH": str(mine), "PARLEY_LOCAL_PREFIX_CACHE_DIR": str(prefixes)}

    first = local_gateway(test_env, tmp_path / "logs", **settings).start()
    try:
        await first.wait_ready(timeout=60)
        reply = await ask(rpc, "hello!")
    finally:
        first.stop()
    assert (reply.provider, reply.model) == ("local", "my-own-model")
    assert parse_response(reply.text) is not None, reply.text
    # Only the chat template's head, evaluated by the warm-up: the stable segment was new.
    assert reply.usage.cached_input_tokens < 30, reply.usage
    [saved] = list(prefixes.glob("*.kv"))

    # A new process: the prefix comes back from disk at start-up, not from this process's memory.
    second = local_gateway(test_env, tmp_path / "logs", **settings).start()
    try:
        await second.wait_ready(timeout=60)
        again = await ask(rpc, "what is 2 + 2?")
    finally:
        second.stop()
    assert parse_response(again.text) is not None, again.text
    assert again.usage.cached_input_tokens >= 50, again.usage  # the stable segment is about 70 tokens
    assert again.usage.cached_input_tokens < again.usage.input_tokens

    # A damaged file is dropped and the prefix evaluated (and saved) again.
    saved.write_bytes(b"not a llama.cpp state file")
    old = time.time() - 60
    os.utime(saved, (old, old))
    third = local_gateway(test_env, tmp_path / "logs", **settings).start()
    try:
        await third.wait_ready(timeout=60)
        recovered = await ask(rpc, "hello!")
    finally:
        third.stop()
    assert parse_response(recovered.text) is not None, recovered.text
    assert [p.stat().st_size > 1000 for p in prefixes.glob("*.kv")] == [True]


async def test_a_missing_model_file_stops_the_gateway_naming_it(test_env: SessionEnv, tmp_path: Path) -> None:
    process = local_gateway(
        test_env, tmp_path / "logs", PARLEY_LOCAL_MODEL_PATH=str(tmp_path / "nowhere" / "absent-model.gguf")
    ).start()
    try:
        with pytest.raises(Exception):  # noqa: B017, PT011 - any failure to become ready
            await process.wait_ready(timeout=30)
        assert process.process is not None
        code = await asyncio.to_thread(process.process.wait, 30)
        assert code != 0
    finally:
        process.stop()
    log = process.log_path.read_text()
    assert "absent-model.gguf" in log
    assert "PARLEY_LOCAL_MODEL_PATH" in log
