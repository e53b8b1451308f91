"""The web connector service: the HTTP server (uvicorn) over the relay to the bus."""

from __future__ import annotations

import asyncio
import contextlib
import socket

import uvicorn

from parley.v1.pairing_nats import PairingClient
from parley.v1.runtime_nats import RuntimeClient
from parley_platform import codes
from parley_platform.host import ServiceHost, ServiceSpec
from parley_platform.logging import get_logger

from .access import Access
from .config import WebSettings
from .mcp_server import McpEndpoint
from .relay import Relay
from .routes import WebApi

log = get_logger(__name__)

SPEC = ServiceSpec("web", identity="web", grpc_port="web_grpc_port", metrics_port="web_metrics_port")


class HttpServer:
    """uvicorn in the service's event loop on a socket bound here (so a taken port is a clear
    PORT_IN_USE at start), started after the relay and stopped before it."""

    def __init__(self, api: WebApi, host: str, port: int) -> None:
        config = uvicorn.Config(
            api.app(), host=host, port=port, log_config=None, access_log=False, lifespan="off"
        )
        self.server = uvicorn.Server(config)
        self.task: asyncio.Task[None] | None = None
        self.host = host
        self.port = port

    async def start(self) -> None:
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((self.host, self.port))
        except OSError as exc:
            sock.close()
            raise codes.PORT_IN_USE(
                f"cannot listen for HTTP on {self.host}:{self.port} (PARLEY_WEB_PORT): {exc.strerror}"
            ) from exc
        self.port = sock.getsockname()[1]
        self.task = asyncio.create_task(self.server.serve(sockets=[sock]), name="http")
        while not self.server.started:
            if self.task.done():
                self.task.result()
                raise codes.INTERNAL(f"the HTTP server stopped while starting on port {self.port}")
            await asyncio.sleep(0.02)

    async def stop(self, timeout: float) -> None:
        self.server.should_exit = True
        if self.task is not None:
            with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
                await asyncio.wait_for(self.task, timeout)


async def setup(host: ServiceHost[WebSettings]) -> None:
    s = host.settings
    relay = Relay(host.bus)
    access = Access(
        PairingClient(host.rpc, timeout=s.web_rpc_timeout_seconds),
        RuntimeClient(host.rpc, timeout=s.web_rpc_timeout_seconds),
        cache_seconds=s.web_cache_seconds,
        history_limit=s.web_history_limit,
    )
    timeout, chars = s.web_reply_timeout_seconds, s.web_max_message_chars
    mcp = McpEndpoint(access, relay, reply_timeout=timeout, max_chars=chars)
    api = WebApi(access, relay, mcp=mcp, reply_timeout=timeout, max_chars=chars)
    http = HttpServer(api, s.web_host, s.web_port)
    host.component("relay", relay)
    host.component("mcp", mcp)
    host.component("http", http)
    host.ready_fields.update(http=f"http://{s.web_host}:{s.web_port}/")
