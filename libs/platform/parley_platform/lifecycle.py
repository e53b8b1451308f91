"""Start-up and graceful shutdown: stop intake, drain with a timeout, close."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from collections.abc import Awaitable, Callable
from typing import Protocol

import uvloop

from .errors import ParleyError
from .logging import configure, get_logger
from .settings import Settings

log = get_logger(__name__)


class ShutdownSignal:
    """Set by SIGINT/SIGTERM (or by ``trigger``); services await it."""

    def __init__(self) -> None:
        self.event = asyncio.Event()

    def install(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, self.trigger, sig.name)

    def trigger(self, reason: str = "requested") -> None:
        if not self.event.is_set():
            log.info("shutdown requested", reason=reason)
            self.event.set()

    async def wait(self) -> None:
        await self.event.wait()


SLOW_STEP_SECONDS = 0.5


async def shutdown_in_order(
    steps: list[tuple[str, Callable[[], Awaitable[object]]]], *, timeout: float
) -> None:
    """Run shutdown steps in order within one overall budget.

    A stuck step is abandoned rather than awaited forever."""
    deadline = time.monotonic() + timeout
    for name, step in steps:
        started = time.monotonic()
        remaining = max(0.1, deadline - started)
        try:
            await asyncio.wait_for(step(), remaining)
            took = time.monotonic() - started
            if took >= SLOW_STEP_SECONDS:
                log.info("slow shutdown step", step=name, seconds=round(took, 2))
        except TimeoutError:
            log.warning("shutdown step timed out", step=name)
        except Exception:
            log.exception("shutdown step failed", step=name)


class App(Protocol):
    async def start(self) -> None: ...
    async def stop(self) -> None: ...


def run_app(service: str, make_app: Callable[[], tuple[App, Settings]]) -> int:
    """Run a service process: configure logs, start, wait for SIGINT/SIGTERM, stop gracefully."""

    async def main() -> int:
        app, settings = make_app()
        configure(service, level=settings.log_level, fmt=settings.log_format)
        shutdown = ShutdownSignal()
        shutdown.install()
        try:
            await app.start()
        except ParleyError as exc:
            log.error("failed to start", service=service, code=exc.code, error=exc.message, hint=exc.hint)
            await app.stop()
            return 2
        await shutdown.wait()
        await app.stop()
        log.info("stopped", service=service)
        return 0

    # uvloop: the libuv event loop spends less per callback, socket read and timer than asyncio's own,
    # and a service's hot path is mostly those (docs/performance.md measures it).
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(main())
