"""The ``code`` handler (off unless the operator enables it): Python in a separate process.

A fence, not a sandbox. The child is ``python -I -S -c BOOTSTRAP`` with an empty environment, a
wall-clock deadline and its stdout/stderr capped. The definition's code, ``params`` and the limits
arrive as one JSON document on stdin: data, never formatted into source. Before the definition's
code is even compiled, the bootstrap:

- becomes ``nobody`` (setgroups, setgid, setuid) when the runtime runs as root and ``nobody`` can
  still run this Python (every directory up to the interpreter and the standard library searchable
  by others); only then does the kernel itself refuse signals to the runtime and enforce
  ``RLIMIT_NPROC``. If the drop is not possible (no such user, a Python under a private home such as
  ``/root``, no CAP_SETUID) the child keeps the runtime's user and only the fence below applies;
- sets rlimits (CPU seconds, address space, file size, no core files, no child processes; the last
  is not enforced for root);
- makes process creation and signals unusable: ``_posixsubprocess`` (whose ``fork_exec`` raises no
  audit event on 3.11), ``subprocess``, ``pty``, ``multiprocessing``, ``socket`` and ``ctypes``
  cannot be imported (a ``sys.meta_path`` finder, ``None`` in ``sys.modules``, an ``import`` audit
  check, and ``_imp.create_builtin``/``create_dynamic`` wrapped so they cannot rebuild them or a
  fresh ``posix``); ``os``/``posix`` ``fork``, ``forkpty``, ``exec*``, ``spawn*``,
  ``posix_spawn*``, ``kill``, ``killpg``, ``system``, ``popen``, ``pidfd_open`` and ``signal``
  ``pthread_kill``/``pidfd_send_signal`` are replaced by functions that refuse;
- installs an audit hook (PEP 578) that refuses socket use, ``ctypes``, the process and signal
  events (``os.system``, ``os.exec``, ``os.spawn``, ``os.posix_spawn``, ``os.fork``, ``os.kill``,
  ``os.killpg``, ``signal.pthread_kill``, ``subprocess.Popen``, ...), changing a limit, and swapping a
  function's code.

What it does not guarantee: everything but the uid drop is enforced by the interpreter the
definition's code runs in, so it is a best-effort fence against mistakes, not a boundary against
hostile code. Code written to escape can find the originals the fence keeps (the wrapped
``_imp`` functions hold them), or use a C extension that is already importable; without the uid
drop the child can read (and, within the file-size limit, write) what the runtime's user can. Enable
code actions only for definitions you trust, and for untrusted ones run the runtime in a container
without network and as a non-root user (or with seccomp).
"""

from __future__ import annotations

import json
import os
import pwd
import stat
import sys
from collections.abc import Mapping

from .definitions import CodeHandler
from .process import ProcessOutcome, run_process

__all__ = ["BOOTSTRAP", "run_code"]

MEMORY_BYTES = 256 * 1024 * 1024
FILE_BYTES = 1024 * 1024

BOOTSTRAP = r"""
import _imp, json, os, posix, resource, signal, sys

_doc = json.loads(sys.stdin.buffer.read().decode("utf-8"))
_user = _doc.get("user")
if _user is not None:
    # The runtime runs as root: become an unprivileged user, so the kernel refuses signals to the
    # runtime and enforces RLIMIT_NPROC. Where that is not permitted the fence below still applies.
    try:
        os.setgroups([])
        os.setgid(_user["gid"])
        os.setuid(_user["uid"])
    except OSError:
        pass
for _name, _value in _doc["limits"].items():
    resource.setrlimit(getattr(resource, _name), (_value, _value))

_DENIED = frozenset({"_posixsubprocess", "subprocess", "pty", "multiprocessing", "_multiprocessing",
                     "socket", "_socket", "ctypes", "_ctypes", "posix", "_signal"})
_PROCESS_EVENTS = ("socket.", "ctypes.", "subprocess.", "os.system", "os.exec", "os.posix_spawn", "os.spawn",
                   "os.fork", "os.forkpty", "os.kill", "os.killpg", "signal.pthread_kill", "pty.",
                   "_posixsubprocess.", "os.startfile", "resource.")

def _refuse(what):
    return PermissionError(f"{what} is not allowed in a code action (no network, no processes)")

class _Refuse:
    @staticmethod
    def find_spec(name, path=None, target=None):
        if name.partition(".")[0] in _DENIED:
            raise _refuse(f"import of {name}")
        return None

sys.meta_path.insert(0, _Refuse)
for _name in ("_posixsubprocess", "subprocess", "pty", "multiprocessing", "_multiprocessing"):
    sys.modules[_name] = None

_create_builtin, _create_dynamic = _imp.create_builtin, _imp.create_dynamic

def _fenced(create):
    def load(spec, *args):
        if spec.name.partition(".")[0] in _DENIED:
            raise _refuse(f"loading {spec.name}")
        return create(spec, *args)
    return load

_imp.create_builtin, _imp.create_dynamic = _fenced(_create_builtin), _fenced(_create_dynamic)
del _create_builtin, _create_dynamic
def _stub(qualname):
    def refused(*args, **kwargs):
        raise _refuse(qualname)
    return refused

for _module in (os, posix):
    for _name in ("fork", "forkpty", "vfork", "execv", "execve", "execl", "execle", "execlp", "execlpe",
                  "execvp", "execvpe", "fexecve", "spawnl", "spawnle", "spawnlp", "spawnlpe", "spawnv",
                  "spawnve", "spawnvp", "spawnvpe", "posix_spawn", "posix_spawnp", "kill", "killpg",
                  "system", "popen", "pidfd_open", "register_at_fork", "_spawnvef", "_execvpe",
                  "_fwalk"):
        if _name in _module.__dict__:
            _module.__dict__[_name] = _stub(f"{_module.__name__}.{_name}")
for _name in ("pthread_kill", "pidfd_send_signal"):
    if _name in signal.__dict__:
        signal.__dict__[_name] = _stub(f"signal.{_name}")
del _module, posix, signal

def _guard(event, args):
    if event.startswith(_PROCESS_EVENTS):
        raise _refuse(event)
    if event == "import" and args and str(args[0]).partition(".")[0] in _DENIED:
        raise _refuse(f"import of {args[0]}")
    if event == "object.__setattr__" and len(args) > 1 and args[1] in ("__code__", "__globals__"):
        raise PermissionError("changing a function's code is not allowed in a code action")

sys.addaudithook(_guard)
del _guard, _fenced, _stub, _name, _value, _user
_ns = {"__name__": "__action__", "__builtins__": __builtins__, "params": _doc["params"]}
_code = compile(_doc["code"], "<custom action>", "exec")
del _doc
exec(_code, _ns)
if _ns.get("result") is not None:
    _r = _ns["result"]
    sys.stdout.write(_r if isinstance(_r, str) else json.dumps(_r, default=str))
"""


def unprivileged_user() -> dict[str, int] | None:
    """``nobody``'s uid and gid when the runtime runs as root and that user could still run this
    Python (every directory up to the standard library searchable by others), else ``None``."""
    if os.geteuid() != 0:
        return None
    try:
        entry = pwd.getpwnam("nobody")
    except KeyError:
        return None
    for path in (os.path.realpath(sys.executable), os.path.dirname(os.__file__)):
        current = path
        while True:
            try:
                mode = os.stat(current).st_mode
            except OSError:
                return None
            if stat.S_ISDIR(mode) and not mode & stat.S_IXOTH:
                return None
            if current == path and not mode & stat.S_IROTH:
                return None
            parent = os.path.dirname(current)
            if parent == current:
                break
            current = parent
    return {"uid": entry.pw_uid, "gid": entry.pw_gid}


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
        "RLIMIT_NPROC": 0,  # not enforced for root; the fence refuses process creation anyway
    }
    document = json.dumps(
        {"code": handler.code, "params": dict(params), "limits": limits, "user": unprivileged_user()},
        default=str,
    )
    return await run_process(
        [sys.executable, "-I", "-S", "-c", BOOTSTRAP],
        stdin=document.encode(),
        timeout=handler.timeout_seconds,
        limit=limit,
    )
