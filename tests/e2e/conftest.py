"""The suite as real processes: the model gateway and runtime replicas."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest


from support import Suite, SessionEnv


@pytest.fixture(scope="session")
async def suite(test_env: SessionEnv, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Suite]:
    """One gateway and one runtime, shared by the e2e tests that do not crash things."""
    running = Suite(test_env, tmp_path_factory.mktemp("logs"))
    running.gateway = running.gateway_process().start()
    await running.gateway.wait_ready()
    running.runtimes.append(running.runtime_process().start())
    try:
        await running.runtime.wait_ready()
        yield running
    finally:
        for process in running.runtimes:
            process.stop()
        running.gateway.stop()
