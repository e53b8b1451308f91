"""Plugins for the plugin-services tests (tests/e2e/test_plugin_services.py): a singleton service
that beats while it runs, a service every replica runs, an event handler, declared settings with
``init``, and a dependency. Each appends a line to the file named by the runtime process's
FIXTURE_LOG variable: what happened, in which process, with which fencing token, and when."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Mapping
from pathlib import Path

from parley_runtime.sdk import EventView, Plugin, ServiceRun, Setting


def _log(*words: object) -> None:
    path = os.environ.get("FIXTURE_LOG")
    if path:
        with Path(path).open("a") as handle:
            handle.write(" ".join(str(w) for w in words) + "\n")


class Ticker:
    """Runs on one replica at a time; beats every BEAT_MS with its fencing token."""

    name = "ticker"
    singleton = True

    def __init__(self) -> None:
        self._task: asyncio.Task[None] | None = None

    async def start(self, run: ServiceRun) -> None:
        _log("SVC_START", os.getpid(), run.fencing_token, repr(time.time()), run.settings["SERVICE_LABEL"])
        self._task = asyncio.ensure_future(self._beat(run))

    async def _beat(self, run: ServiceRun) -> None:
        interval = int(run.settings["BEAT_MS"]) / 1000  # type: ignore[call-overload]
        while True:
            _log("SVC_BEAT", os.getpid(), run.fencing_token, repr(time.time()))
            await asyncio.sleep(interval)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        _log("SVC_STOP", os.getpid(), "-", repr(time.time()))

    async def health(self) -> bool:
        return self._task is not None and not self._task.done()


class Local:
    """Runs on every replica."""

    name = "local"

    async def start(self, run: ServiceRun) -> None:
        _log("LOCAL_START", os.getpid(), run.fencing_token)

    async def stop(self) -> None:
        _log("LOCAL_STOP", os.getpid())


async def _base_init(settings: Mapping[str, object]) -> None:
    _log("INIT", os.getpid(), "base", "-")


async def _init(settings: Mapping[str, object]) -> None:
    _log("INIT", os.getpid(), "services", settings["SERVICE_LABEL"], type(settings["BEAT_MS"]).__name__)


async def _run_ended(event: EventView) -> None:
    _log("EVENT", os.getpid(), event.type, event.turn_id, event.attributes.get("status", ""))


base_plugin = Plugin(name="base_fixtures", init=_base_init)

service_plugin = Plugin(
    name="service_fixtures",
    services=(Ticker(), Local()),
    events={"RUN_ENDED": (_run_ended,)},
    config=(
        Setting("SERVICE_LABEL", "a label the services log", required=True),
        Setting(
            "BEAT_MS", "how often the ticker beats", default=200, schema={"type": "integer", "minimum": 10}
        ),
    ),
    init=_init,
    dependencies=("plugins.service_fixtures:base_plugin",),
)
