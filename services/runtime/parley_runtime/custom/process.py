"""Running a handler's child process: no inherited environment, limits, a deadline, capped output."""

from __future__ import annotations

import asyncio
import contextlib
import os
import resource
import signal
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass

__all__ = ["ProcessOutcome", "limits", "run_process"]

OUTPUT_CHARS = 4000


@dataclass(frozen=True)
class ProcessOutcome:
    returncode: int | None  # None: killed at the deadline
    output: str
    truncated: bool
    timed_out: bool


def limits(
    *, cpu_seconds: int, memory_bytes: int | None, file_bytes: int, no_fork: bool
) -> Callable[[], None]:
    """A preexec function setting rlimits in the child, before it executes anything."""

    def apply() -> None:
        resource.setrlimit(resource.RLIMIT_CPU, (cpu_seconds, cpu_seconds))
        resource.setrlimit(resource.RLIMIT_FSIZE, (file_bytes, file_bytes))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        if memory_bytes is not None:
            resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
        if no_fork:
            # Not enforced for root (or CAP_SYS_RESOURCE); the code sandbox also refuses process
            # creation in its audit hook.
            resource.setrlimit(resource.RLIMIT_NPROC, (0, 0))

    return apply


async def run_process(
    argv: Sequence[str],
    *,
    stdin: bytes | None,
    timeout: float,
    limit: int = OUTPUT_CHARS,
    preexec: Callable[[], None] | None = None,
) -> ProcessOutcome:
    """Run ``argv`` (no shell) with an empty environment in a fresh temporary directory, in its own
    process group; stdout and stderr together, read up to ``limit`` characters; killed (with its
    group) at the deadline. Output past the limit is read and dropped."""
    wanted = limit * 4
    with tempfile.TemporaryDirectory(prefix="parley-action-") as workdir:
        process = await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.PIPE if stdin is not None else asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            env={},
            cwd=workdir,
            start_new_session=True,
            preexec_fn=preexec,
        )
        chunks: list[bytes] = []
        size = 0
        timed_out = truncated = False

        async def pump() -> None:
            nonlocal size, truncated
            assert process.stdout is not None
            if stdin is not None and process.stdin is not None:
                with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                    process.stdin.write(stdin)
                    await process.stdin.drain()
                process.stdin.close()
            while chunk := await process.stdout.read(65536):
                if size <= wanted:  # past the cap the rest is drained, so the exit status stays real
                    chunks.append(chunk)
                    size += len(chunk)
                else:
                    truncated = True
            await process.wait()

        try:
            await asyncio.wait_for(pump(), timeout)
        except TimeoutError:
            timed_out = True
        finally:
            if process.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                await process.wait()
        text = b"".join(chunks)[:wanted].decode("utf-8", errors="replace")
        if len(text) > limit:
            text, truncated = text[:limit], True
        return ProcessOutcome(None if timed_out else process.returncode, text, truncated, timed_out)
