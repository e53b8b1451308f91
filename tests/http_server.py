"""A real HTTP/1.1 server on 127.0.0.1 for the custom http action's tests and benchmark.

It records each request and answers by path: ``/redirect`` → 302 to ``/echo``, ``/big`` → 20,000
characters, ``/hang`` → nothing for 30 s, ``/gzip-bomb`` and ``/deflate-bomb`` → 10 MB of zeros
compressed (whatever the request accepts), ``/charset/<name>`` → UTF-8 text labelled ``<name>``,
``/status/<code>`` → that status, anything else → 200 with the request as JSON.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import ssl
import zlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Recorded:
    method: str
    target: str
    headers: dict[str, str]
    body: bytes


@dataclass
class LocalHttpServer:
    host: str = "127.0.0.1"
    port: int = 0
    requests: list[Recorded] = field(default_factory=list)
    record: bool = True
    tls: ssl.SSLContext | None = None
    _server: asyncio.Server | None = None

    @property
    def base(self) -> str:
        return f"{'https' if self.tls else 'http'}://{self.host}:{self.port}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                line = await reader.readline()
                if not line:
                    return
                method, target, _ = line.decode("latin-1").split(" ", 2)
                headers: dict[str, str] = {}
                while (raw := await reader.readline()) not in (b"\r\n", b"\n", b""):
                    name, _, value = raw.decode("latin-1").partition(":")
                    headers[name.strip().lower()] = value.strip()
                body = await reader.readexactly(int(headers.get("content-length", "0")))
                if self.record:
                    self.requests.append(Recorded(method, target, headers, body))
                if target.startswith("/hang"):
                    await asyncio.sleep(30)
                status, extra, payload = self._answer(method, target, headers, body)
                head = f"HTTP/1.1 {status} X\r\nContent-Length: {len(payload)}\r\n"
                head += "".join(f"{k}: {v}\r\n" for k, v in extra.items())
                writer.write(head.encode() + b"\r\n" + payload)
                await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError, ValueError):
            return
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()

    def _answer(
        self, method: str, target: str, headers: dict[str, str], body: bytes
    ) -> tuple[int, dict[str, str], bytes]:
        if target.startswith("/redirect"):
            return 302, {"Location": f"{self.base}/echo"}, b""
        if target.startswith("/big"):
            return 200, {"Content-Type": "text/plain"}, b"x" * 20_000
        if target.startswith(("/gzip-bomb", "/deflate-bomb")):
            gzip = target.startswith("/gzip")
            packer = zlib.compressobj(9, zlib.DEFLATED, 31 if gzip else 15)
            payload = packer.compress(bytes(10 * 1024 * 1024)) + packer.flush()
            return (
                200,
                {"Content-Type": "text/plain", "Content-Encoding": "gzip" if gzip else "deflate"},
                payload,
            )
        if target.startswith("/charset/"):
            label = target.split("/")[2]
            return (
                200,
                {"Content-Type": f"text/plain; charset={label}"},
                "caf\u00e9 \udcff".encode("utf-8", errors="surrogateescape"),
            )
        if target.startswith("/status/"):
            return int(target.split("/")[2]), {}, b"nope"
        document: dict[str, Any] = {
            "method": method,
            "target": target,
            "headers": headers,
            "body": body.decode("utf-8", errors="replace"),
        }
        return 200, {"Content-Type": "application/json"}, json.dumps(document).encode()

    async def start(self) -> LocalHttpServer:
        self._server = await asyncio.start_server(self._serve, self.host, self.port, ssl=self.tls)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()


@contextlib.asynccontextmanager
async def local_http_server(
    host: str = "127.0.0.1", tls: ssl.SSLContext | None = None
) -> AsyncIterator[LocalHttpServer]:
    server = await LocalHttpServer(host, tls=tls).start()
    try:
        yield server
    finally:
        await server.stop()
