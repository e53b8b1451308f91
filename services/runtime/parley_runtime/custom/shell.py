"""The ``shell`` handler (off unless the operator enables it).

A command without shell syntax is split with ``shlex`` first and each parameter is put into its
argument as data, then it is executed directly: no shell sees the values. A command that needs a
shell (pipes, redirections, ``$``, globs) runs as ``/bin/sh -c SCRIPT sh VALUE...``: each
``{{name}}`` of the script is rewritten to a positional parameter reference (``"${1}"``; ``${1}`` in
a here-document body), so the values are never part of the script and are expanded exactly once, as
data, wherever they appear. Refused when a definition is added: a placeholder as the program to run
(in either path), inside quotes, glued to other text, in shell arithmetic or in a quoted
here-document. Options are the author's job: a value starting with ``-`` is still an argument the
program may read as an option; put ``--`` before placeholders where the program supports it.
"""

from __future__ import annotations

import re
import shlex
import shutil
from collections.abc import Mapping

from .definitions import PLACEHOLDER, ShellHandler, heredoc_bodies, needs_shell, param_text, render
from .process import ProcessOutcome, limits, run_process

__all__ = ["SAFE_PATH", "shell_argv"]

SAFE_PATH = "/usr/local/bin:/usr/bin:/bin"
MEMORY_BYTES = 1024 * 1024 * 1024
FILE_BYTES = 16 * 1024 * 1024


class CommandNotFound(Exception):
    pass


def shell_script(command: str) -> tuple[str, list[str]]:
    """The command with each ``{{name}}`` replaced by a positional parameter reference (``"${N}"``,
    or ``${N}`` in a here-document body), and the names in parameter order."""
    names: list[str] = []
    bodies = heredoc_bodies(command)

    def reference(match: re.Match[str]) -> str:
        name = match.group(1)
        if name not in names:
            names.append(name)
        ref = f"${{{names.index(name) + 1}}}"
        in_body = any(start <= match.start() < end for start, end, _ in bodies)
        return ref if in_body else f'"{ref}"'

    return PLACEHOLDER.sub(reference, command), names


def shell_argv(command: str, params: Mapping[str, object]) -> list[str]:
    if needs_shell(command):
        # The values never become part of the script: sh reads them as "$1", "$2", ... (data).
        script, names = shell_script(command)
        return ["/bin/sh", "-c", script, "sh", *(param_text(params.get(name)) for name in names)]
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
