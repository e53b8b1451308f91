"""The ``http`` handler: render the request, pass it through the SSRF guard, send it pinned.

``{{param}}`` is URI-encoded in the URL (every reserved character, so a value cannot add a path,
a query or a host) and JSON-escaped in the body (inside a JSON string it is escaped; outside one it
becomes a whole JSON string), so a value never leaves the string it was put in. Redirects are not
followed, the whole exchange has one deadline, and at most ``limit`` characters of the response
are read. The request asks for no compression (``Accept-Encoding: identity``) and a compressed
response is refused: the cap counts raw bytes, never what they would decompress to.
"""

from __future__ import annotations

import asyncio
import json
import ssl
from collections.abc import Mapping
from dataclasses import dataclass
from urllib.parse import quote

import httpx

from .definitions import HttpHandler, json_string_spans, render
from .ssrf import Guard, SsrfBlocked

__all__ = ["HttpOutcome", "render_body", "render_url", "run_http"]

TIMEOUT_SECONDS = 15.0
RESPONSE_CHARS = 4000
_ssl_context: ssl.SSLContext | None = None


def _tls() -> ssl.SSLContext:
    global _ssl_context
    if _ssl_context is None:  # loading the CA bundle costs milliseconds: once per process
        _ssl_context = httpx.create_ssl_context()
    return _ssl_context


def _path_span(template: str) -> tuple[int, int]:
    """The ``[start, end)`` offsets of the URL template's path (after the authority, before ``?``/``#``)."""
    authority = template.find("://") + 3 if "://" in template else 0
    start = template.find("/", authority)
    if start < 0:
        return len(template), len(template)
    ends = [i for i in (template.find("?", start), template.find("#", start)) if i >= 0]
    return start, min(ends, default=len(template))


def render_url(template: str, params: Mapping[str, object]) -> str:
    """Every reserved character of a value is percent-encoded; in the path a ``.`` is ``%2E`` too, so
    a value ``..`` or ``.`` is not a dot segment that the client or a server would remove."""
    start, end = _path_span(template)

    def encode(value: str, offset: int) -> str:
        quoted = quote(value, safe="")
        return quoted.replace(".", "%2E") if start <= offset < end else quoted

    return render(template, params, encode)


def render_body(template: str, params: Mapping[str, object]) -> str:
    spans = json_string_spans(template)

    def encode(value: str, offset: int) -> str:
        inside = any(start < offset < end for start, end in spans)
        quoted = json.dumps(value, ensure_ascii=False)
        return quoted[1:-1] if inside else quoted

    return render(template, params, encode)


def render_header(template: str, params: Mapping[str, object]) -> str:
    # A header value cannot be escaped: control characters (CR/LF would start a new header) are dropped.
    return render(template, params, lambda value, _: "".join(c for c in value if c >= " " and c != "\x7f"))


@dataclass(frozen=True)
class HttpOutcome:
    ok: bool
    output: str
    status: int = 0


async def run_http(
    handler: HttpHandler,
    params: Mapping[str, object],
    guard: Guard,
    *,
    timeout: float = TIMEOUT_SECONDS,
    limit: int = RESPONSE_CHARS,
    tls: ssl.SSLContext | None = None,
) -> HttpOutcome:
    """``tls``: the context that verifies servers (default: the system's CA bundle)."""
    try:
        async with asyncio.timeout(timeout):
            return await _exchange(handler, params, guard, timeout, limit, tls or _tls())
    except TimeoutError:
        return HttpOutcome(False, f"the request took longer than {timeout:.0f}s")
    except SsrfBlocked as exc:
        return HttpOutcome(False, exc.message)
    except (LookupError, UnicodeError):
        # A parameter (or a secret) that cannot be sent: a lone surrogate in the URL, a non-ASCII
        # character in a header value.
        return HttpOutcome(False, "the request cannot be sent: a value is not valid text for a URL or header")


async def _exchange(
    handler: HttpHandler,
    params: Mapping[str, object],
    guard: Guard,
    timeout: float,
    limit: int,
    tls: ssl.SSLContext,
) -> HttpOutcome:
    target = await guard.check(render_url(handler.url, params))
    headers = {name: render_header(value, params) for name, value in handler.headers.items()}
    headers = {k: v for k, v in headers.items() if k.lower() != "accept-encoding"}
    headers["Host"] = target.host_header
    # No compression: the cap below counts the bytes received, and a compressed body could expand
    # to far more than that (a decompression bomb) before any cap applied.
    headers["Accept-Encoding"] = "identity"
    body = None
    if handler.body_template is not None:
        body = render_body(handler.body_template, params).encode()
        if not any(k.lower() == "content-type" for k in headers):
            headers["Content-Type"] = "application/json"
    extensions = {"sni_hostname": target.server_name} if target.https else {}
    async with httpx.AsyncClient(
        follow_redirects=False,
        trust_env=False,  # no proxy from the environment: the request goes to the checked address
        timeout=timeout,
        verify=tls,
        limits=httpx.Limits(max_keepalive_connections=0),
    ) as client:
        request = client.build_request(
            handler.method, target.url, headers=headers, content=body, extensions=extensions
        )
        try:
            response = await client.send(request, stream=True)
        except httpx.HTTPError as exc:
            return HttpOutcome(False, f"the request failed: {type(exc).__name__}")
        try:
            if response.is_redirect or 300 <= response.status_code < 400:
                return HttpOutcome(
                    False,
                    f"blocked: the server answered {response.status_code} (a redirect); "
                    "custom http actions do not follow redirects",
                    response.status_code,
                )
            encoding = response.headers.get("content-encoding", "identity").strip().lower()
            if encoding not in ("", "identity"):
                return HttpOutcome(
                    False,
                    f"refused: the server sent a {encoding[:40]}-encoded response although the request "
                    "asked for no compression (Accept-Encoding: identity)",
                    response.status_code,
                )
            text = await _read(response, limit)
        except httpx.HTTPError as exc:
            return HttpOutcome(False, f"reading the response failed: {type(exc).__name__}")
        finally:
            await response.aclose()
    ok = 200 <= response.status_code < 300
    return HttpOutcome(ok, text if ok else f"HTTP {response.status_code}: {text}", response.status_code)


async def _read(response: httpx.Response, limit: int) -> str:
    wanted = limit * 4  # UTF-8 needs at most 4 bytes a character
    chunks: list[bytes] = []
    size = 0
    async for chunk in response.aiter_raw():  # the bytes as received: nothing is decompressed
        chunks.append(chunk)
        size += len(chunk)
        if size >= wanted:
            break
    data = b"".join(chunks)[:wanted]
    try:
        text = data.decode(response.charset_encoding or "utf-8", errors="replace")
    except (LookupError, UnicodeError):  # a charset Python does not know, or not a text encoding
        text = data.decode("utf-8", errors="replace")
    return text[:limit]
