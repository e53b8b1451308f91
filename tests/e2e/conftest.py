"""The suite as real processes: the model gateway and runtime replicas."""

from __future__ import annotations

import contextlib
import secrets
from collections.abc import AsyncIterator

import nats.js.errors
import pytest

from support import SessionEnv, Suite


@pytest.fixture(scope="session")
async def suite(test_env: SessionEnv, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Suite]:
    """One gateway and one runtime in the session's namespace, shared by tests that do not crash things."""
    running = Suite(test_env, tmp_path_factory.mktemp("logs"), test_env.namespace)
    try:
        yield await running.start()
    finally:
        running.stop()


@pytest.fixture
async def isolated_suite(
    test_env: SessionEnv, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[Suite]:
    """A suite in a namespace of its own (own streams and consumers), for tests that kill processes.

    The test starts the processes it needs; every one is stopped afterwards.
    """
    running = Suite(test_env, tmp_path_factory.mktemp("logs"), f"x{secrets.token_hex(4)}")
    try:
        yield running
    finally:
        running.stop()
        bus = await running.connect()
        try:
            for name in ("INBOUND", "OUTBOUND", "EVENTS", "DEAD"):
                with contextlib.suppress(nats.js.errors.NotFoundError):
                    await bus.js.delete_stream(bus.subjects.stream(name))
        finally:
            await bus.close()
