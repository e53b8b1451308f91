"""The SSRF guard of the http handler: public http(s) addresses only, and the connection pinned.

``Guard.check(url)`` parses the URL, turns every legacy IPv4 spelling (``2130706433``,
``0x7f000001``, ``0177.0.0.1``, ``127.1``) into its address, refuses metadata and local names,
resolves a name once and checks *every* address it resolves to. It returns a ``Target`` whose URL
names the checked address itself, with the original host kept for the ``Host`` header and for TLS
(SNI and certificate verification). The HTTP client connects to that address and never resolves
the name again, so a DNS answer that changes between the check and the connection (rebinding)
cannot reach a blocked address.

The operator may allow hosts explicitly (``PARLEY_CUSTOM_ACTIONS_ALLOW_HOSTS``): a name (its
addresses are then not checked, the connection is still pinned), an address or a CIDR network.
"""

from __future__ import annotations

import asyncio
import ipaddress
import re
import socket
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit, urlunsplit

from parley_platform.errors import InvalidArgument

from .. import errors

__all__ = ["Guard", "SsrfBlocked", "Target", "parse_ipv4_literal", "system_resolver"]

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
Resolver = Callable[[str, int], Awaitable[Sequence[str]]]

RESOLVE_TIMEOUT_SECONDS = 5.0
METADATA_NAMES = frozenset(
    {
        "metadata",
        "metadata.google.internal",
        "metadata.goog",
        "metadata.azure.com",
        "metadata.packet.net",
        "metadata.platformequinix.com",
        "instance-data",
        "instance-data.ec2.internal",
        "localhost",
        "localhost.localdomain",
        "ip6-localhost",
        "ip6-loopback",
    }
)
BLOCKED_SUFFIXES = (".local", ".localhost", ".internal", ".localdomain", ".home.arpa")
CGNAT = ipaddress.IPv4Network("100.64.0.0/10")
RFC1918 = tuple(ipaddress.IPv4Network(n) for n in ("10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16"))
BROADCAST = ipaddress.IPv4Address("255.255.255.255")
ULA = ipaddress.IPv6Network("fc00::/7")
NAT64 = ipaddress.IPv6Network("64:ff9b::/96")
IPV4_COMPATIBLE = ipaddress.IPv6Network("::/96")
SITE_LOCAL = ipaddress.IPv6Network("fec0::/10")
# Ranges refused by name, whatever the ipaddress module's tables say in this Python version.
SPECIAL_NETWORKS: tuple[tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, str], ...] = (
    (ipaddress.IPv4Network("192.0.0.0/24"), "an IETF protocol assignment address (192.0.0.0/24)"),
    (ipaddress.IPv4Network("192.0.2.0/24"), "a documentation address (192.0.2.0/24)"),
    (ipaddress.IPv4Network("198.18.0.0/15"), "a benchmarking address (198.18.0.0/15)"),
    (ipaddress.IPv4Network("198.51.100.0/24"), "a documentation address (198.51.100.0/24)"),
    (ipaddress.IPv4Network("203.0.113.0/24"), "a documentation address (203.0.113.0/24)"),
    (ipaddress.IPv4Network("240.0.0.0/4"), "a reserved address (240.0.0.0/4)"),
    (ipaddress.IPv6Network("2001:db8::/32"), "a documentation address (2001:db8::/32)"),
    (ipaddress.IPv6Network("3fff::/20"), "a documentation address (3fff::/20)"),
)
_NUMERIC_HOST = re.compile(r"^(0x[0-9a-f]*|[0-9]+)(\.(0x[0-9a-f]*|[0-9]+)){0,3}$")


class SsrfBlocked(InvalidArgument):
    """The URL may not be fetched: what was refused is in the message, without the URL's secrets."""

    default_code = errors.SSRF_BLOCKED.code


@dataclass(frozen=True)
class Target:
    url: str  # the URL to request: its host is the checked address
    host_header: str  # the original host (and port when not the default)
    server_name: str  # the original host name, for TLS SNI and certificate checks
    address: str
    https: bool


async def system_resolver(host: str, port: int) -> list[str]:
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return [str(info[4][0]) for info in infos]


def _number(part: str) -> int:
    if part.startswith("0x"):
        return int(part[2:] or "0", 16)
    if len(part) > 1 and part.startswith("0"):
        return int(part, 8)  # ValueError for 8 or 9: not an address
    return int(part)


def parse_ipv4_literal(host: str) -> ipaddress.IPv4Address | None:
    """The address an inet_aton-style spelling stands for (``127.1``, ``0x7f000001``, ``0177.0.0.1``,
    ``2130706433``), ``None`` when ``host`` is not numeric. Raises ``SsrfBlocked`` for a numeric
    host that is no valid address: resolvers disagree on those, so none of them gets to decide."""
    lowered = host.lower().rstrip(".")
    if not _NUMERIC_HOST.match(lowered):
        return None
    parts = lowered.split(".")
    try:
        numbers = [_number(p) for p in parts]
    except ValueError:
        raise SsrfBlocked(
            "blocked: the host is a malformed numeric address", code="SSRF_BAD_ADDRESS"
        ) from None
    *head, last = numbers
    if any(n > 255 for n in head) or last >= 256 ** (4 - len(head)):
        raise SsrfBlocked("blocked: the host is a numeric address out of range", code="SSRF_BAD_ADDRESS")
    value = 0
    for n in head:
        value = value * 256 + n
    value = value * 256 ** (4 - len(head)) + last
    return ipaddress.IPv4Address(value)


def blocked_reason(address: IPAddress) -> str | None:
    """Why ``address`` is not public, or ``None`` for a public unicast address."""
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            return "an IPv4-mapped IPv6 address"
        if address.scope_id:
            return "an IPv6 address with a zone"
        if address.teredo is not None:
            return "a Teredo address"
        embedded = address.sixtofour
        if embedded is None and address in NAT64:
            embedded = ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
        if embedded is not None:
            inner = blocked_reason(embedded)
            if inner is not None:
                return f"an IPv6 address embedding {inner}"
        if address in IPV4_COMPATIBLE and not address.is_loopback and not address.is_unspecified:
            return "an IPv4-compatible IPv6 address"
        if address in ULA:
            return "a unique local IPv6 address (fc00::/7)"
        if address in SITE_LOCAL:
            return "a site-local IPv6 address (fec0::/10)"
    if address.is_unspecified:
        return "the unspecified address"
    if address.is_loopback:
        return "a loopback address"
    if address.is_link_local:
        return "a link-local address (cloud metadata lives here)"
    if address.is_multicast:
        return "a multicast address"
    if isinstance(address, ipaddress.IPv4Address) and address in CGNAT:
        return "a carrier-grade NAT address (100.64.0.0/10)"
    if address == BROADCAST:
        return "the broadcast address"
    for network, what in SPECIAL_NETWORKS:
        if address.version == network.version and address in network:
            return what
    if address.is_reserved:
        return "a reserved address"
    if any(address in network for network in RFC1918):
        return "a private address (RFC 1918)"
    if address.is_private or not address.is_global:
        return "a special-purpose address, not a public one"
    return None


def _address(text: str) -> IPAddress:
    return ipaddress.ip_address(text)


class Guard:
    def __init__(self, allow_hosts: Iterable[str] = (), resolver: Resolver | None = None) -> None:
        self.resolver: Resolver = resolver or system_resolver
        self.allowed_names: set[str] = set()
        self.allowed_networks: list[ipaddress.IPv4Network | ipaddress.IPv6Network] = []
        for entry in (e.strip().lower() for e in allow_hosts):
            if not entry:
                continue
            try:
                self.allowed_networks.append(ipaddress.ip_network(entry.strip("[]"), strict=False))
            except ValueError:
                self.allowed_names.add(entry.rstrip("."))

    def _allowed(self, address: IPAddress) -> bool:
        return any(address.version == n.version and address in n for n in self.allowed_networks)

    def check_address(self, address: IPAddress, host: str) -> None:
        if self._allowed(address):
            return
        reason = blocked_reason(address)
        if reason is not None:
            what = "is" if host == str(address) else f"resolves to {address}:"
            raise SsrfBlocked(
                f"blocked: {host} {what} {reason}; custom http actions reach public addresses only",
                hint="an operator can allow a host with PARLEY_CUSTOM_ACTIONS_ALLOW_HOSTS",
            )

    async def check(self, url: str) -> Target:
        try:
            parts = urlsplit(url)
            port = parts.port
        except ValueError:
            raise SsrfBlocked("blocked: the URL cannot be parsed", code="SSRF_BAD_URL") from None
        scheme = parts.scheme.lower()
        if scheme not in ("http", "https"):
            raise SsrfBlocked("blocked: only http and https URLs may be fetched", code="SSRF_BAD_URL")
        if parts.username is not None or parts.password is not None:
            raise SsrfBlocked(
                "blocked: the URL must not carry user info (user:password@)", code="SSRF_BAD_URL"
            )
        raw_host = parts.hostname or ""
        if not raw_host:
            raise SsrfBlocked("blocked: the URL has no host", code="SSRF_BAD_URL")
        default_port = 443 if scheme == "https" else 80
        port = port if port is not None else default_port
        address, host = self._literal(raw_host)
        if address is not None:
            self.check_address(address, host)
        else:
            address = await self._resolve(host, port)
        netloc_host = f"[{address}]" if address.version == 6 else str(address)
        bracketed = f"[{host}]" if ":" in host else host
        target_url = urlunsplit((scheme, f"{netloc_host}:{port}", parts.path or "/", parts.query, ""))
        return Target(
            url=target_url,
            host_header=bracketed if port == default_port else f"{bracketed}:{port}",
            server_name=host,
            address=str(address),
            https=scheme == "https",
        )

    def _literal(self, raw_host: str) -> tuple[IPAddress | None, str]:
        """The address a literal host names (and the host as shown), or ``None`` and the name."""
        if ":" in raw_host:
            try:
                return ipaddress.IPv6Address(raw_host), raw_host
            except ValueError:
                raise SsrfBlocked(
                    "blocked: the host is a malformed IPv6 address", code="SSRF_BAD_URL"
                ) from None
        try:
            # IDNA first: it folds full-width digits and ideographic dots into ASCII, so
            # "１２７。0。0。1" is recognised below as the loopback address it spells.
            name = raw_host.encode("idna").decode("ascii").lower().rstrip(".")
        except UnicodeError:
            raise SsrfBlocked("blocked: the host is not a valid name", code="SSRF_BAD_URL") from None
        v4 = parse_ipv4_literal(name)
        if v4 is not None:
            return v4, raw_host
        if not name or not re.fullmatch(r"[a-z0-9_.-]+", name):
            raise SsrfBlocked("blocked: the host is not a valid name", code="SSRF_BAD_URL")
        return None, name

    async def _resolve(self, name: str, port: int) -> IPAddress:
        allowed_name = name in self.allowed_names
        if not allowed_name and (name in METADATA_NAMES or name.endswith(BLOCKED_SUFFIXES)):
            raise SsrfBlocked(
                f"blocked: {name} is a local or cloud metadata name",
                hint="an operator can allow a host with PARLEY_CUSTOM_ACTIONS_ALLOW_HOSTS",
            )
        try:
            async with asyncio.timeout(RESOLVE_TIMEOUT_SECONDS):
                answers = list(await self.resolver(name, port))
        except (OSError, TimeoutError):
            raise SsrfBlocked(f"blocked: {name} cannot be resolved", code="SSRF_UNRESOLVED") from None
        addresses: list[IPAddress] = []
        for answer in answers:
            try:
                addresses.append(_address(answer))
            except ValueError:
                raise SsrfBlocked(
                    f"blocked: {name} resolves to something that is not an address", code="SSRF_UNRESOLVED"
                ) from None
        if not addresses:
            raise SsrfBlocked(f"blocked: {name} has no addresses", code="SSRF_UNRESOLVED")
        if not allowed_name:
            for address in addresses:  # every one: the client must not get to pick a blocked one
                self.check_address(address, name)
        return addresses[0]
