"""A small TCP proxy for fault injection: latency on every chunk, and connections dropped on demand.

The fault-injection suite puts one in front of PostgreSQL and one in front of NATS, so the
services' connections can be slowed down and cut while the servers themselves keep running
(``parley_devinfra.faults``).
"""

from __future__ import annotations

import asyncio
import contextlib

HOST = "127.0.0.1"
CHUNK = 65536


class TcpProxy:
    """Listens on a free port of 127.0.0.1 and forwards each connection to ``upstream_port``."""

    def __init__(self, upstream_port: int, *, upstream_host: str = HOST) -> None:
        self.upstream_host = upstream_host
        self.upstream_port = upstream_port
        self.latency = 0.0  # seconds added before each forwarded chunk, both directions
        self.port = 0
        self.accepted = 0
        self.dropped = 0
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    async def start(self, port: int = 0) -> int:
        self._server = await asyncio.start_server(self._serve, HOST, port)
        self.port = int(self._server.sockets[0].getsockname()[1])
        return self.port

    def drop(self) -> int:
        """Cut every open connection at once (an RST, as a network fault would)."""
        writers, self._writers = self._writers, set()
        for writer in writers:
            writer.transport.abort()
        self.dropped += len(writers) // 2
        return len(writers) // 2

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            self.drop()
            with contextlib.suppress(Exception):
                await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        try:
            up_reader, up_writer = await asyncio.open_connection(self.upstream_host, self.upstream_port)
        except OSError:
            writer.transport.abort()
            return
        self._writers |= {writer, up_writer}
        try:
            await asyncio.gather(self._pump(reader, up_writer), self._pump(up_reader, writer))
        finally:
            for each in (writer, up_writer):
                self._writers.discard(each)
                each.transport.abort()

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while chunk := await reader.read(CHUNK):
                if self.latency:
                    await asyncio.sleep(self.latency)
                writer.write(chunk)
                await writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            # One side closed or failed: close the other, so both ends see the cut.
            writer.transport.abort()
