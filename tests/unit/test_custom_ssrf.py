"""The SSRF guard of custom http actions: a table of addresses and URL spellings, then real requests
to a real HTTP server on 127.0.0.1 (let through by the operator's allowlist for the positive cases)."""

from __future__ import annotations

import json
import ssl
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from http_server import local_http_server

from parley_runtime.custom.definitions import HttpHandler
from parley_runtime.custom.http import run_http
from parley_runtime.custom.ssrf import Guard, SsrfBlocked

PUBLIC_V4 = "93.184.216.34"
PUBLIC_V6 = "2606:2800:220:1:248:1893:25c8:1946"

ANSWERS: dict[str, list[str]] = {
    "example.com": [PUBLIC_V4],
    "dual.example": [PUBLIC_V6, PUBLIC_V4],
    "private.example": ["10.0.0.1"],
    "mixed.example": [PUBLIC_V4, "10.0.0.1"],
    "mixed-late.example": [PUBLIC_V4, PUBLIC_V6, "192.168.0.7"],
    "loop.example": ["127.0.0.1"],
    "mapped.example": ["::ffff:127.0.0.1"],
    "ula.example": ["fd00::1"],
    "meta.example": ["169.254.169.254"],
    "cgnat.example": ["100.64.1.1"],
    "sitelocal.example": [PUBLIC_V6, "fec0::1"],
}


async def table_resolver(host: str, port: int) -> list[str]:
    if host not in ANSWERS:
        raise OSError(f"no such host {host}")
    return ANSWERS[host]


BLOCKED: list[tuple[str, str]] = [
    # loopback in every spelling
    ("http://127.0.0.1/", "loopback"),
    ("http://127.0.0.2:8080/x", "loopback"),
    ("http://0x7f000001/", "loopback"),
    ("http://2130706433/", "loopback"),
    ("http://0177.0.0.1/", "loopback"),
    ("http://127.1/", "loopback"),
    ("http://0x7f.1/", "loopback"),
    ("http://017700000001/", "loopback"),
    ("http://0x7F.0.0.1/", "loopback"),
    ("http://localhost/", "local or cloud metadata name"),
    ("http://LOCALHOST./", "local or cloud metadata name"),
    ("http://foo.localhost/", "local or cloud metadata name"),
    ("http://[::1]/", "loopback"),
    ("http://127\u30020\u30020\u30021/", "loopback"),
    ("http://\uff11\uff12\uff17.0.0.1/", "loopback"),
    ("http://%31%32%37.0.0.1/", "not a valid name"),
    ("http://[0:0:0:0:0:0:0:1]:81/", "loopback"),
    # unspecified
    ("http://0/", "unspecified"),
    ("http://0.0.0.0/", "unspecified"),
    ("http://[::]/", "unspecified"),
    # RFC 1918
    ("http://10.0.0.1/", "private"),
    ("http://10.255.255.255/", "private"),
    ("http://172.16.0.1/", "private"),
    ("http://172.31.255.255/", "private"),
    ("http://192.168.1.1/", "private"),
    ("http://012.0.0.1/", "private"),
    ("http://167772161/", "private"),
    # link-local and cloud metadata
    ("http://169.254.169.254/latest/meta-data/", "link-local"),
    ("http://0xa9fea9fe/", "link-local"),
    ("http://169.254.0.1/", "link-local"),
    ("http://[fe80::1]/", "link-local"),
    ("http://[fe80::1%25eth0]/", "zone"),
    ("http://metadata.google.internal/computeMetadata/v1/", "local or cloud metadata name"),
    ("http://metadata.google.internal./", "local or cloud metadata name"),
    ("http://METADATA.GOOGLE.INTERNAL/", "local or cloud metadata name"),
    ("http://metadata/", "local or cloud metadata name"),
    ("http://instance-data/", "local or cloud metadata name"),
    ("http://anything.internal/", "local or cloud metadata name"),
    ("http://[fd00:ec2::254]/", "unique local"),
    # CGNAT, multicast, broadcast, reserved, documentation
    ("http://100.64.0.1/", "carrier-grade NAT"),
    ("http://100.127.255.254/", "carrier-grade NAT"),
    ("http://100.100.100.200/", "carrier-grade NAT"),
    ("http://224.0.0.1/", "multicast"),
    ("http://239.255.255.250:1900/", "multicast"),
    ("http://[ff02::1]/", "multicast"),
    ("http://255.255.255.255/", "broadcast"),
    ("http://240.0.0.1/", "reserved"),
    ("http://255.255.255.254/", "reserved address (240.0.0.0/4)"),
    ("http://192.0.0.8/", "IETF protocol assignment"),
    ("http://192.0.2.1/", "documentation address (192.0.2.0/24)"),
    ("http://198.18.0.1/", "benchmarking"),
    ("http://198.19.255.254/", "benchmarking"),
    ("http://198.51.100.7/", "documentation address (198.51.100.0/24)"),
    ("http://203.0.113.9/", "documentation address (203.0.113.0/24)"),
    ("http://[2001:db8::1]/", "documentation address (2001:db8::/32)"),
    ("http://[3fff::1]/", "documentation address (3fff::/20)"),
    ("http://[3fff:fff:ffff::1]/", "documentation address (3fff::/20)"),
    # IPv6 site-local (deprecated, still routed inside some networks)
    ("http://[fec0::1]/", "site-local"),
    ("http://[feff:ffff::1]/", "site-local"),
    # IPv6 forms that carry IPv4
    ("http://[::ffff:10.0.0.1]/", "IPv4-mapped"),
    ("http://[::ffff:127.0.0.1]/", "IPv4-mapped"),
    ("http://[::ffff:8.8.8.8]/", "IPv4-mapped"),
    ("http://[::ffff:7f00:1]/", "IPv4-mapped"),
    ("http://[2002:7f00:1::]/", "embedding a loopback"),
    ("http://[64:ff9b::a00:1]/", "embedding a private"),
    ("http://[::10.0.0.1]/", "IPv4-compatible"),
    ("http://[2001:0:4136:e378:8000:63bf:3fff:fdd2]/", "Teredo"),
    # IPv6 unique local
    ("http://[fc00::1]/", "unique local"),
    ("http://[fd12:3456:789a::1]/", "unique local"),
    # .local (mDNS)
    ("http://foo.local/", "local or cloud metadata name"),
    ("http://printer.LOCAL./", "local or cloud metadata name"),
    # names that resolve to blocked addresses: every answer is checked
    ("http://private.example/", "resolves to 10.0.0.1: a private address"),
    ("http://mixed.example/", "resolves to 10.0.0.1"),
    ("http://mixed-late.example/", "resolves to 192.168.0.7"),
    ("http://loop.example:8080/", "loopback"),
    ("http://mapped.example/", "IPv4-mapped"),
    ("http://ula.example/", "unique local"),
    ("http://meta.example/", "link-local"),
    ("http://cgnat.example/", "carrier-grade NAT"),
    ("http://sitelocal.example/", "resolves to fec0::1: a site-local"),
    ("http://nowhere.example/", "cannot be resolved"),
    # not http(s), or spelled to confuse parsers
    ("ftp://example.com/", "only http and https"),
    ("file:///etc/passwd", "only http and https"),
    ("gopher://example.com:70/", "only http and https"),
    ("http://user:pass@example.com/", "user info"),
    ("http://example.com@127.0.0.1/", "user info"),
    ("http://999.0.0.1/", "out of range"),
    ("http://08.0.0.1/", "malformed numeric"),
    ("http://1.2.3.256/", "out of range"),
    ("http:///path-only", "no host"),
    ("http://[::1/", "cannot be parsed"),
]

ALLOWED: list[tuple[str, str, str]] = [
    # url, the address connected to, the URL actually requested
    (f"http://{PUBLIC_V4}/", PUBLIC_V4, f"http://{PUBLIC_V4}:80/"),
    ("https://example.com/a/b?c=d", PUBLIC_V4, f"https://{PUBLIC_V4}:443/a/b?c=d"),
    (f"http://[{PUBLIC_V6}]:8080/", PUBLIC_V6, f"http://[{PUBLIC_V6}]:8080/"),
    ("http://8.8.8.8:8080/path?q=1", "8.8.8.8", "http://8.8.8.8:8080/path?q=1"),
    ("http://0x08080808/", "8.8.8.8", "http://8.8.8.8:80/"),
    ("http://134744072/", "8.8.8.8", "http://8.8.8.8:80/"),
    ("http://dual.example/", PUBLIC_V6, f"http://[{PUBLIC_V6}]:80/"),
    ("HTTP://Example.COM./#frag", PUBLIC_V4, f"http://{PUBLIC_V4}:80/"),
    ("http://192.0.3.1/", "192.0.3.1", "http://192.0.3.1:80/"),  # just past 192.0.2.0/24
    ("http://198.20.0.1/", "198.20.0.1", "http://198.20.0.1:80/"),  # just past 198.18.0.0/15
    ("http://[2001:db9::1]/", "2001:db9::1", "http://[2001:db9::1]:80/"),  # just past 2001:db8::/32
]


def test_the_table_is_large_enough() -> None:
    assert len(BLOCKED) + len(ALLOWED) >= 40


@pytest.mark.parametrize(("url", "why"), BLOCKED)
async def test_blocked(url: str, why: str) -> None:
    with pytest.raises(SsrfBlocked) as caught:
        await Guard(resolver=table_resolver).check(url)
    assert why in caught.value.message
    assert caught.value.message.startswith("blocked:")


@pytest.mark.parametrize(("url", "address", "requested"), ALLOWED)
async def test_allowed_public_addresses_are_pinned(url: str, address: str, requested: str) -> None:
    target = await Guard(resolver=table_resolver).check(url)
    assert target.address == address
    assert target.url == requested


async def test_host_header_and_tls_name_keep_the_original_host() -> None:
    target = await Guard(resolver=table_resolver).check("https://example.com:8443/x")
    assert (target.host_header, target.server_name, target.https) == ("example.com:8443", "example.com", True)


async def test_allowlist_by_address_network_and_name() -> None:
    guard = Guard(["127.0.0.1", "10.1.0.0/16", "private.example"], resolver=table_resolver)
    assert (await guard.check("http://127.0.0.1:9/")).address == "127.0.0.1"
    assert (await guard.check("http://10.1.2.3/")).address == "10.1.2.3"
    assert (await guard.check("http://private.example/")).address == "10.0.0.1"
    with pytest.raises(SsrfBlocked, match="loopback"):
        await guard.check("http://127.0.0.2/")  # only what was allowed
    with pytest.raises(SsrfBlocked, match="IPv4-mapped"):
        await guard.check("http://[::ffff:127.0.0.1]/")


# -- against a real server ---------------------------------------------------------------------


def handler(url: str, **extra: object) -> HttpHandler:
    return HttpHandler.model_validate({"type": "http", "url": url, **extra})


async def test_loopback_server_is_blocked_without_the_allowlist_and_never_contacted() -> None:
    async with local_http_server() as server:
        outcome = await run_http(handler(f"{server.base}/echo"), {}, Guard())
    assert not outcome.ok
    assert "loopback" in outcome.output
    assert server.requests == []


async def test_allowed_host_is_reached_and_params_are_uri_encoded() -> None:
    async with local_http_server() as server:
        value = "a b&c=/d?#e/../@evil.example"
        outcome = await run_http(
            handler(f"{server.base}/echo?q={{{{q}}}}"), {"q": value}, Guard(["127.0.0.1"])
        )
    assert outcome.ok, outcome.output
    [request] = server.requests
    assert request.target == "/echo?q=a%20b%26c%3D%2Fd%3F%23e%2F..%2F%40evil.example"
    assert request.headers["host"] == f"127.0.0.1:{server.port}"
    assert json.loads(outcome.output)["target"] == request.target


async def test_a_redirect_is_blocked_and_not_followed() -> None:
    async with local_http_server() as server:
        outcome = await run_http(handler(f"{server.base}/redirect"), {}, Guard(["127.0.0.1"]))
    assert not outcome.ok
    assert "redirect" in outcome.output
    assert outcome.status == 302
    assert [r.target for r in server.requests] == ["/redirect"]


async def test_a_name_resolving_to_a_private_address_is_blocked() -> None:
    async def resolver(host: str, port: int) -> Sequence[str]:
        return ["10.0.0.1"]

    outcome = await run_http(handler("http://api.example/"), {}, Guard(resolver=resolver))
    assert not outcome.ok
    assert outcome.output.startswith("blocked: api.example resolves to 10.0.0.1: a private address")


async def test_dns_rebinding_cannot_move_the_connection_after_the_check() -> None:
    """The first answer is checked (and allowed); later answers would be private. The request goes
    to the checked address, and the name is resolved exactly once."""
    calls: list[str] = []

    async def rebinding(host: str, port: int) -> Sequence[str]:
        calls.append(host)
        return ["127.0.0.1"] if len(calls) == 1 else ["10.0.0.1"]

    async with local_http_server() as server:
        url = f"http://rebind.example:{server.port}/echo"
        outcome = await run_http(handler(url), {}, Guard(["127.0.0.1"], resolver=rebinding))
    assert outcome.ok, outcome.output
    assert calls == ["rebind.example"]
    [request] = server.requests
    assert request.headers["host"] == f"rebind.example:{server.port}"


async def test_a_public_then_private_answer_is_blocked_as_a_whole() -> None:
    async def resolver(host: str, port: int) -> Sequence[str]:
        return [PUBLIC_V4, "10.0.0.1"]

    outcome = await run_http(handler("http://api.example/"), {}, Guard(resolver=resolver))
    assert not outcome.ok
    assert "10.0.0.1" in outcome.output


async def test_body_template_values_stay_strings() -> None:
    nasty = 'a"b\\c}}{{q}}", "admin": true, "x": {"y": "\n\u2028'
    template = '{"q": "{{q}}", "bare": {{q}}, "nested": {"k": "prefix {{q}} suffix"}}'
    async with local_http_server() as server:
        outcome = await run_http(
            handler(f"{server.base}/echo", method="POST", bodyTemplate=template),
            {"q": nasty},
            Guard(["127.0.0.1"]),
        )
    assert outcome.ok, outcome.output
    [request] = server.requests
    assert request.method == "POST"
    assert request.headers["content-type"] == "application/json"
    assert json.loads(request.body) == {"q": nasty, "bare": nasty, "nested": {"k": f"prefix {nasty} suffix"}}


async def test_header_values_cannot_add_headers() -> None:
    async with local_http_server() as server:
        outcome = await run_http(
            handler(f"{server.base}/echo", headers={"X-Q": "{{q}}"}),
            {"q": "v\r\nX-Evil: 1"},
            Guard(["127.0.0.1"]),
        )
    assert outcome.ok, outcome.output
    [request] = server.requests
    assert "x-evil" not in request.headers
    assert request.headers["x-q"] == "vX-Evil: 1"


async def test_response_is_capped_at_4000_characters() -> None:
    async with local_http_server() as server:
        outcome = await run_http(handler(f"{server.base}/big"), {}, Guard(["127.0.0.1"]))
    assert outcome.ok
    assert outcome.output == "x" * 4000


async def test_error_status_is_a_failure_and_the_deadline_holds() -> None:
    async with local_http_server() as server:
        failed = await run_http(handler(f"{server.base}/status/404"), {}, Guard(["127.0.0.1"]))
        slow = await run_http(handler(f"{server.base}/hang"), {}, Guard(["127.0.0.1"]), timeout=0.5)
    assert (failed.ok, failed.output) == (False, "HTTP 404: nope")
    assert not slow.ok
    assert "took longer" in slow.output


def _certificates(tmp: Path, name: str) -> tuple[ssl.SSLContext, ssl.SSLContext]:
    """A CA and a server certificate for ``name`` only (no IP address in it): the server's TLS
    context, and a client context that trusts the CA."""
    now = datetime.now(UTC)

    def build(subject: str, issuer: x509.Name | None, key: ec.EllipticCurvePrivateKey, signer: Any) -> Any:
        subject_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)])
        builder = (
            x509.CertificateBuilder()
            .subject_name(subject_name)
            .issuer_name(issuer or subject_name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - timedelta(minutes=5))
            .not_valid_after(now + timedelta(hours=1))
        )
        if issuer is None:
            builder = builder.add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        else:
            builder = builder.add_extension(
                x509.SubjectAlternativeName([x509.DNSName(subject)]), critical=False
            )
        return builder.sign(signer, hashes.SHA256())

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = build("parley test CA", None, ca_key, ca_key)
    leaf_key = ec.generate_private_key(ec.SECP256R1())
    leaf = build(name, ca.subject, leaf_key, ca_key)
    (tmp / "ca.pem").write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    (tmp / "leaf.pem").write_bytes(leaf.public_bytes(serialization.Encoding.PEM))
    (tmp / "leaf.key").write_bytes(
        leaf_key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    server = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server.load_cert_chain(tmp / "leaf.pem", tmp / "leaf.key")
    client = ssl.create_default_context(cafile=str(tmp / "ca.pem"))
    return server, client


async def test_https_is_pinned_to_the_checked_address_and_verified_for_the_name(tmp_path: Path) -> None:
    """The connection goes to the checked address (127.0.0.1) while SNI and the certificate check
    use the URL's name: the certificate names secure.example only, so it verifies for that name and
    fails for another name that resolves to the same address."""
    server_tls, client_tls = _certificates(tmp_path, "secure.example")

    async def resolver(host: str, port: int) -> Sequence[str]:
        return ["127.0.0.1"]

    guard = Guard(["127.0.0.1"], resolver=resolver)
    async with local_http_server(tls=server_tls) as server:
        good = await run_http(
            handler(f"https://secure.example:{server.port}/echo"), {}, guard, tls=client_tls
        )
        wrong = await run_http(
            handler(f"https://wrong.example:{server.port}/echo"), {}, guard, tls=client_tls
        )
    assert good.ok, good.output
    assert json.loads(good.output)["headers"]["host"] == f"secure.example:{server.port}"
    assert not wrong.ok
    assert wrong.output == "the request failed: ConnectError"
    assert len(server.requests) == 1


# -- what a value can do to the request ------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "received"),
    [
        ("..", "/users/%2E%2E/profile?v=.."),
        (".", "/users/%2E/profile?v=."),
        ("../admin", "/users/%2E%2E%2Fadmin/profile?v=..%2Fadmin"),
        ("a.b", "/users/a%2Eb/profile?v=a.b"),
    ],
)
async def test_dot_segment_values_stay_in_their_path_segment(value: str, received: str) -> None:
    """httpx (and servers) remove "." and ".." segments: a value must not become one."""
    async with local_http_server() as server:
        outcome = await run_http(
            handler(f"{server.base}/users/{{{{id}}}}/profile?v={{{{id}}}}"),
            {"id": value},
            Guard(["127.0.0.1"]),
        )
    assert outcome.ok, outcome.output
    assert [r.target for r in server.requests] == [received]


async def test_compressed_responses_are_refused_before_decompression() -> None:
    """A 10 MB gzip bomb (a few kB on the wire): the request asks for identity, and the response is
    refused by its Content-Encoding, never decompressed."""
    async with local_http_server() as server:
        outcome = await run_http(handler(f"{server.base}/gzip-bomb"), {}, Guard(["127.0.0.1"]))
        deflated = await run_http(handler(f"{server.base}/deflate-bomb"), {}, Guard(["127.0.0.1"]))
        plain = await run_http(
            handler(f"{server.base}/echo", headers={"Accept-Encoding": "gzip"}), {}, Guard(["127.0.0.1"])
        )
    assert not outcome.ok
    assert outcome.output.startswith("refused: the server sent a gzip-encoded response")
    assert not deflated.ok
    assert "deflate-encoded" in deflated.output
    assert plain.ok, plain.output
    assert [r.headers["accept-encoding"] for r in server.requests] == ["identity"] * 3


@pytest.mark.parametrize(
    ("extra", "params"),
    [
        ({"url": "http://127.0.0.1:PORT/echo?q={{q}}"}, {"q": "\ud800"}),  # a lone surrogate
        ({"url": "http://127.0.0.1:PORT/echo", "headers": {"X-Q": "{{q}}"}}, {"q": "caf\u00e9"}),
        ({"url": "http://127.0.0.1:PORT/echo", "method": "POST", "bodyTemplate": '"{{q}}"'}, {"q": "\udfff"}),
    ],
)
async def test_values_that_cannot_be_sent_are_a_clear_failure(
    extra: dict[str, Any], params: dict[str, str]
) -> None:
    async with local_http_server() as server:
        spec = {"type": "http", **extra, "url": str(extra["url"]).replace("PORT", str(server.port))}
        outcome = await run_http(HttpHandler.model_validate(spec), params, Guard(["127.0.0.1"]))
    assert not outcome.ok
    assert outcome.output.startswith("the request cannot be sent")
    assert server.requests == []


async def test_an_unknown_charset_falls_back_to_utf8() -> None:
    async with local_http_server() as server:
        outcome = await run_http(
            handler(f"{server.base}/charset/x-no-such-charset"), {}, Guard(["127.0.0.1"])
        )
        odd = await run_http(handler(f"{server.base}/charset/hex"), {}, Guard(["127.0.0.1"]))
    assert (outcome.ok, outcome.output) == (True, "caf\u00e9 \ufffd")
    assert (odd.ok, odd.output) == (True, "caf\u00e9 \ufffd")
