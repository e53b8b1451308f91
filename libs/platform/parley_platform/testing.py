"""Helpers for tests that use the real thing: databases, service processes, polling."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import IO, TypeVar

import grpc
import psycopg
from grpc_health.v1 import health_pb2, health_pb2_grpc
from psycopg import sql

from .grpcserver import open_channel

T = TypeVar("T")


async def eventually(
    check: Callable[[], Awaitable[T]],
    *,
    timeout: float = 10.0,
    interval: float = 0.05,
    what: str = "condition",
) -> T:
    """Poll ``check`` until it returns a truthy value (which is returned) or the deadline passes."""
    deadline = time.monotonic() + timeout
    last: T | None = None
    while True:
        last = await check()
        if last:
            return last
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not reached within {timeout}s (last value: {last!r})")
        await asyncio.sleep(interval)


def with_database(url: str, database: str) -> str:
    """The same server URL, pointing at another database."""
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(url)
    return urlunsplit(parts._replace(path=f"/{database}"))


def create_database(url: str, name: str) -> str:
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    return with_database(url, name)


def drop_database(url: str, name: str) -> None:
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))


class ServiceProcess:
    """A service started as a real process (``python -m module``), its output kept in a log file."""

    def __init__(
        self,
        module: str,
        env: Mapping[str, str],
        log_path: Path,
        grpc_port: int,
        *,
        grpc_tls_ca: Path | None = None,
    ) -> None:
        self.module = module
        self.grpc_tls_ca = grpc_tls_ca  # the service serves gRPC over TLS, its certificate signed by this CA
        self.env = {**os.environ, **env, "PYTHONUNBUFFERED": "1"}
        self.log_path = log_path
        self.grpc_port = grpc_port
        self.process: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    def start(self) -> ServiceProcess:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = self.log_path.open("ab")
        self.process = subprocess.Popen(
            [sys.executable, "-m", self.module],
            env=self.env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        return self

    async def wait_ready(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        async with open_channel(f"127.0.0.1:{self.grpc_port}", tls_ca=self.grpc_tls_ca) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while time.monotonic() < deadline:
                if self.process is not None and self.process.poll() is not None:
                    raise AssertionError(
                        f"{self.module} exited with {self.process.returncode}:\n{self.log()}"
                    )
                try:
                    reply = await stub.Check(health_pb2.HealthCheckRequest(), timeout=1)
                    if reply.status == health_pb2.HealthCheckResponse.SERVING:
                        return
                except grpc.aio.AioRpcError:
                    pass
                await asyncio.sleep(0.1)
        raise AssertionError(f"{self.module} not ready within {timeout}s:\n{self.log()}")

    def log(self, tail: int = 60) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-tail:])
        except OSError:
            return ""

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def kill(self) -> None:
        """SIGKILL: the crash case, no graceful anything."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(10)
        if self._log:
            self._log.close()

    def stop(self, timeout: float = 15.0) -> int | None:
        if self.process is None:
            return None
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5)
        if self._log:
            self._log.close()
        return self.process.returncode
