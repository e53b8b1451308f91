"""The ``code`` handler (off unless the operator enables it): Python in a separate process.

The child is ``python -I -S -c BOOTSTRAP`` with an empty environment, rlimits it sets on itself
before the definition's code is even parsed (CPU seconds, address space, file size, no core files,
no child processes for non-root users), a wall-clock deadline, and its stdout/stderr capped. The
definition's code, ``params`` and the limits arrive as one JSON document on stdin: data, never
formatted into source. Before the code runs, the bootstrap installs an audit hook (PEP 578) that
refuses socket use (creation, connect, bind, name lookups), ``ctypes`` loading, process creation
(subprocess, os.system, exec, spawn, fork), changing a limit, and swapping a function's code. The
code prints its answer, or sets ``result``.

What this is not: a security boundary against hostile code. The child runs as the runtime's user and
can read what that user can read; audit hooks are a best-effort fence inside one interpreter (a C
extension that is already importable could open a socket without raising an event). Enable code
actions only for definitions you trust, or run the runtime itself in a container without network.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping

from .definitions import CodeHandler
from .process import ProcessOutcome, run_process

__all__ = ["BOOTSTRAP", "run_code"]

MEMORY_BYTES = 256 * 1024 * 1024
FILE_BYTES = 1024 * 1024

BOOTSTRAP = r"""
import json, resource, sys

_doc = json.loads(sys.stdin.buffer.read().decode("utf-8"))
for _name, _value in _doc["limits"].items():
    resource.setrlimit(getattr(resource, _name), (_value, _value))

def _guard(event, args):
    if event.startswith(("socket.", "ctypes.", "subprocess.", "os.system", "os.exec", "os.posix_spawn",
                         "os.spawn", "os.fork", "os.forkpty", "pty.", "_posixsubprocess.", "os.startfile",
                         "resource.")):
        raise PermissionError(f"{event} is not allowed in a code action (no network, no processes)")
    if event == "object.__setattr__" and len(args) > 1 and args[1] in ("__code__", "__globals__"):
        raise PermissionError("changing a function's code is not allowed in a code action")

sys.addaudithook(_guard)
del _guard
_ns = {"__name__": "__action__", "__builtins__": __builtins__, "params": _doc["params"]}
_code = compile(_doc["code"], "<custom action>", "exec")
del _doc
exec(_code, _ns)
if _ns.get("result") is not None:
    _r = _ns["result"]
    sys.stdout.write(_r if isinstance(_r, str) else json.dumps(_r, default=str))
"""


async def run_code(handler: CodeHandler, params: Mapping[str, object], *, limit: int) -> ProcessOutcome:
    # The child sets its own limits before any of the definition's code exists in it (and the
    # audit hook then refuses changing them): no preexec function, so spawning stays fork-safe in
    # the runtime's threaded process.
    cpu = int(handler.timeout_seconds) + 1
    limits = {
        "RLIMIT_CPU": cpu,
        "RLIMIT_AS": MEMORY_BYTES,
        "RLIMIT_FSIZE": FILE_BYTES,
        "RLIMIT_CORE": 0,
        "RLIMIT_NPROC": 0,  # not enforced for root; the audit hook refuses process creation anyway
    }
    document = json.dumps({"code": handler.code, "params": dict(params), "limits": limits}, default=str)
    return await run_process(
        [sys.executable, "-I", "-S", "-c", BOOTSTRAP],
        stdin=document.encode(),
        timeout=handler.timeout_seconds,
        limit=limit,
    )
