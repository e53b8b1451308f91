"""The ``shell`` handler (off unless the operator enables it).

A command without shell syntax is split with ``shlex`` first and each parameter is put into its
argument as data, then it is executed directly: no shell sees the values. A command that needs a
shell (pipes, redirections, ``$``, globs) runs under ``/bin/sh -c`` with every value shell-quoted;
definitions that put a placeholder inside quotes there are refused when added, because inside
``"..."`` a quoted value would still be expanded.
"""

from __future__ import annotations

import shlex
import shutil
from collections.abc import Mapping

from .definitions import ShellHandler, needs_shell, render
from .process import ProcessOutcome, limits, run_process

__all__ = ["SAFE_PATH", "shell_argv"]

SAFE_PATH = "/usr/local/bin:/usr/bin:/bin"
MEMORY_BYTES = 1024 * 1024 * 1024
FILE_BYTES = 16 * 1024 * 1024


class CommandNotFound(Exception):
    pass


def shell_argv(command: str, params: Mapping[str, object]) -> list[str]:
    if needs_shell(command):
        return ["/bin/sh", "-c", render(command, params, lambda value, _: shlex.quote(value))]
    argv = [render(token, params, lambda value, _: value) for token in shlex.split(command)]
    program = argv[0] if "/" in argv[0] else shutil.which(argv[0], path=SAFE_PATH)
    if program is None:
        raise CommandNotFound(f"{argv[0]!r} is not a program on {SAFE_PATH}")
    return [program, *argv[1:]]


async def run_shell(handler: ShellHandler, params: Mapping[str, object], *, limit: int) -> ProcessOutcome:
    argv = shell_argv(handler.command, params)
    cpu = int(handler.timeout_seconds) + 1
    prlimit = shutil.which("prlimit", path=SAFE_PATH)
    if prlimit is not None:
        # util-linux's prlimit sets the limits and executes the command: no Python preexec function
        # in the runtime's threaded process (a fork there is not safe to run Python in).
        argv = [
            prlimit,
            f"--cpu={cpu}",
            f"--as={MEMORY_BYTES}",
            f"--fsize={FILE_BYTES}",
            "--core=0",
            "--",
            *argv,
        ]
        preexec = None
    else:
        preexec = limits(cpu_seconds=cpu, memory_bytes=MEMORY_BYTES, file_bytes=FILE_BYTES, no_fork=False)
    return await run_process(argv, stdin=None, timeout=handler.timeout_seconds, limit=limit, preexec=preexec)
