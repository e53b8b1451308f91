"""NATS and JetStream behind one adapter: connection, subjects, streams, publish.

No ``nats.errors`` escapes this module or its siblings (``consumer``, ``rpc``):
they are translated into ``parley_platform.errors``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import ssl
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

import nats
import nats.errors
import nats.js.errors
from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.api import (
    AckPolicy,
    ConsumerConfig,
    DeliverPolicy,
    DiscardPolicy,
    RetentionPolicy,
    StorageType,
    StreamConfig,
)

from . import codes
from .errors import ParleyError
from .logging import get_logger
from .permissions import inbox_prefix

log = get_logger(__name__)

MSG_ID = "Nats-Msg-Id"
# The status of the message the server sends to a request's reply subject when nobody serves it.
NO_RESPONDERS_STATUS = "503"
REPLICAS_ENV = "PARLEY_STREAM_REPLICAS"
MAX_REPLICAS = 5  # JetStream's own limit
_PERMISSION_VIOLATION = re.compile(r'permissions violation for publish to "([^"]+)"', re.IGNORECASE)


class Subjects:
    """Every subject and stream name, derived from one namespace.

    The namespace is ``parley`` in production; each test session picks its own
    so that runs sharing a NATS server never see each other's messages.
    """

    def __init__(self, namespace: str = "parley") -> None:
        self.ns = namespace

    def stream(self, name: str) -> str:
        return f"{self.ns.upper()}_{name}"

    def inbound(self, agent_id: str, source: str) -> str:
        """Where a connector publishes its agent's messages; the source is in the subject, so the
        server enforces that a connector publishes only for its own."""
        return f"{self.ns}.inbound.{agent_id}.{source}"

    def self_inbound(self, agent_id: str) -> str:
        """Messages the runtime gives itself (a continuation, an autonomous thought): only the
        runtime may publish here, so nothing a connector sends can start such a turn."""
        return f"{self.ns}.self.{agent_id}"

    def outbound(self, agent_id: str, source: str) -> str:
        return f"{self.ns}.outbound.{agent_id}.{source}"

    def chunks(self, agent_id: str, source: str) -> str:
        """Where the runtime publishes a reply's text as it is generated (core NATS, StreamChunk)."""
        return f"{self.ns}.stream.{agent_id}.{source}"

    def cancel(self, agent_id: str, source: str) -> str:
        """Where a connector cancels its source's turns (CancelTurnRequest; every runtime listens)."""
        return f"{self.ns}.cancel.{agent_id}.{source}"

    def events(self, agent_id: str, event_type: str) -> str:
        return f"{self.ns}.events.{agent_id}.{event_type}"

    def dead(self, stream: str) -> str:
        return f"{self.ns}.dead.{stream}"

    def rpc(self, service: str, method: str) -> str:
        return f"{self.ns}.{service}.{method}"

    def all(self, kind: str) -> str:
        return f"{self.ns}.{kind}.>"


@dataclass(frozen=True)
class StreamSpec:
    """The stream configuration we want; ``ensure_stream`` makes the server agree."""

    name: str
    subjects: list[str]
    max_age_seconds: float = 0
    duplicate_window_seconds: float = 120
    max_msg_size: int = 1024 * 1024 * 2
    retention: RetentionPolicy = RetentionPolicy.LIMITS
    replicas: int = 1
    max_bytes: int = -1

    def config(self) -> StreamConfig:
        return StreamConfig(
            name=self.name,
            subjects=self.subjects,
            retention=self.retention,
            storage=StorageType.FILE,
            max_age=self.max_age_seconds,
            duplicate_window=self.duplicate_window_seconds,
            max_msg_size=self.max_msg_size,
            num_replicas=self.replicas,
            max_bytes=self.max_bytes,
            discard=DiscardPolicy.OLD,
        )


@dataclass(frozen=True)
class ConsumerSpec:
    """A durable pull consumer shared by every replica of a service."""

    stream: str
    durable: str
    filter_subject: str  # "": the whole stream
    ack_wait_seconds: float = 30
    max_deliver: int = 5
    max_ack_pending: int = 1000
    extra: Mapping[str, Any] = field(default_factory=dict)

    def config(self) -> ConsumerConfig:
        return ConsumerConfig(
            durable_name=self.durable,
            deliver_policy=DeliverPolicy.ALL,
            ack_policy=AckPolicy.EXPLICIT,
            ack_wait=self.ack_wait_seconds,
            max_deliver=self.max_deliver,
            filter_subject=self.filter_subject or None,
            max_ack_pending=self.max_ack_pending,
            **self.extra,
        )


def stream_replicas() -> int:
    """How many copies of each stream the suite keeps: ``PARLEY_STREAM_REPLICAS`` (default 1; 3 on
    a three-node cluster), so every place that creates a stream agrees without being told."""
    raw = os.environ.get(REPLICAS_ENV, "").strip() or "1"
    if not raw.isdigit() or not 1 <= int(raw) <= MAX_REPLICAS:
        raise codes.INVALID_ARGUMENT(
            f"{REPLICAS_ENV} must be a whole number from 1 to {MAX_REPLICAS}, not {raw!r}"
        )
    return int(raw)


def standard_streams(subjects: Subjects, *, replicas: int | None = None) -> list[StreamSpec]:
    """The suite's event streams (see DESIGN.md), each with ``replicas`` copies (default:
    ``stream_replicas()``)."""
    day = 24 * 3600.0
    replicas = stream_replicas() if replicas is None else replicas
    return [
        StreamSpec(
            subjects.stream("INBOUND"),
            [subjects.all("inbound"), subjects.all("self")],
            max_age_seconds=7 * day,
            duplicate_window_seconds=600,
            replicas=replicas,
        ),
        StreamSpec(
            subjects.stream("OUTBOUND"),
            [subjects.all("outbound")],
            max_age_seconds=7 * day,
            duplicate_window_seconds=600,
            replicas=replicas,
        ),
        StreamSpec(
            subjects.stream("EVENTS"),
            [subjects.all("events")],
            max_age_seconds=day,
            duplicate_window_seconds=120,
            replicas=replicas,
        ),
        StreamSpec(
            subjects.stream("DEAD"),
            [subjects.all("dead")],
            max_age_seconds=30 * day,
            duplicate_window_seconds=600,
            replicas=replicas,
        ),
    ]


_STREAM_FIELDS = (
    "subjects",
    "retention",
    "storage",
    "max_age",
    "duplicate_window",
    "max_msg_size",
    "num_replicas",
    "max_bytes",
    "discard",
)
_CONSUMER_FIELDS = (
    "ack_policy",
    "ack_wait",
    "max_deliver",
    "filter_subject",
    "max_ack_pending",
    "deliver_policy",
)


def _differences(live: Any, wanted: Any, names: tuple[str, ...]) -> list[str]:
    return [n for n in names if getattr(wanted, n) is not None and getattr(live, n) != getattr(wanted, n)]


class Bus:
    """A connected NATS client with its JetStream context."""

    def __init__(self, nc: Client, subjects: Subjects, denied: dict[str, float] | None = None) -> None:
        self.nc = nc
        self.js: JetStreamContext = nc.jetstream()
        self.subjects = subjects
        self._mark_closing: Callable[[], None] = lambda: None
        # Subjects the server refused this identity to publish to, and when (its -ERR arrives on
        # its own, not as the answer to the publish or request that caused it).
        self._denied = denied if denied is not None else {}

    def denied(self, subject: str, within: float = 60.0) -> bool:
        """Whether the server refused publishing to ``subject`` in the last ``within`` seconds."""
        at = self._denied.get(subject.lower())
        return at is not None and time.monotonic() - at <= within

    @classmethod
    async def connect(
        cls,
        url: str,
        *,
        name: str,
        namespace: str = "parley",
        connect_timeout: float = 5.0,
        user: str | None = None,
        password: str | None = None,
        tls: ssl.SSLContext | None = None,
        inbox: str | None = None,
    ) -> Bus:
        """Connect as ``user`` (or the user in the URL); ``url`` may list several servers,
        comma-separated. Replies come to the identity's own inbox prefix (``inbox`` overrides it),
        which is the only one its permissions let it read."""
        closing = False
        servers = [u.strip() for u in url.split(",") if u.strip()]
        identity = user or _url_user(servers[0])

        async def on_disconnect() -> None:
            if not closing:
                log.warning("nats disconnected", service=name)

        async def on_reconnect() -> None:
            log.info("nats reconnected", service=name)

        async def on_closed() -> None:
            if not closing:
                log.info("nats connection closed", service=name)

        denied: dict[str, float] = {}

        async def on_error(exc: Exception) -> None:
            refused = _PERMISSION_VIOLATION.search(str(exc))
            if refused:
                denied[refused.group(1).lower()] = time.monotonic()
            log.warning("nats error", service=name, error=str(exc))

        options: dict[str, Any] = {
            "name": name,
            "max_reconnect_attempts": -1,
            "reconnect_time_wait": 0.5,
            "connect_timeout": connect_timeout,
            "allow_reconnect": True,
            "disconnected_cb": on_disconnect,
            "reconnected_cb": on_reconnect,
            "closed_cb": on_closed,
            "error_cb": on_error,
        }
        if user is not None:
            options.update(user=user, password=password or "")
        if inbox is not None or identity:
            options["inbox_prefix"] = inbox or inbox_prefix(identity or "")
        if tls is not None:
            options["tls"] = tls
        nc = Client()
        try:
            # With unlimited reconnects nats-py retries the *first* connection forever too;
            # bound it here so an unreachable server fails fast instead of hanging startup.
            async with asyncio.timeout(connect_timeout):
                await nc.connect(servers, **options)
        except (TimeoutError, OSError, nats.errors.Error) as exc:
            closing = True
            cause = nc.last_error or exc
            with contextlib.suppress(Exception):
                await nc.close()
            raise codes.NATS_UNAVAILABLE(
                f"cannot connect to NATS at {_redact_url(url)}: {type(cause).__name__}"
            ) from exc
        log.debug("nats connected", service=name)
        bus = cls(nc, Subjects(namespace), denied)

        def mark_closing() -> None:
            nonlocal closing
            closing = True

        bus._mark_closing = mark_closing
        return bus

    async def ensure_stream(self, spec: StreamSpec, *, timeout: float = 60.0) -> str:
        """Create the stream, or update it when the live config differs. Returns what was done.

        A cluster still electing its meta leader, or a replicated stream's group still forming,
        answers with a timeout or "JetStream unavailable": that is waited out (a create that timed
        out but happened is then found by the next look) until ``timeout`` has passed."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                return await self._ensure_stream_once(spec)
            except ParleyError as exc:
                transient = exc.code in (codes.NATS_TIMEOUT.code, codes.JETSTREAM_UNAVAILABLE.code)
                if not transient or time.monotonic() >= deadline:
                    raise
                log.warning("stream not ready yet; retrying", stream=spec.name, error=exc.message)
                await asyncio.sleep(0.5)

    async def _ensure_stream_once(self, spec: StreamSpec) -> str:
        wanted = spec.config()
        try:
            info = await self.js.stream_info(spec.name)
        except nats.js.errors.NotFoundError:
            try:
                await self.js.add_stream(wanted)
            except nats.js.errors.BadRequestError as exc:
                if "already in use" not in str(exc):
                    raise _translate(exc, f"create stream {spec.name}") from exc
                return "exists"
            except (TimeoutError, nats.errors.Error) as exc:
                raise _translate(exc, f"create stream {spec.name}") from exc
            return "created"
        except (TimeoutError, nats.errors.Error) as exc:
            raise _translate(exc, f"stream info {spec.name}") from exc
        changed = _differences(info.config, wanted, _STREAM_FIELDS)
        if not changed:
            return "unchanged"
        try:
            await self.js.update_stream(wanted)
        except nats.js.errors.BadRequestError as exc:
            what = f"update stream {spec.name} ({', '.join(changed)})"
            if "peer offline" in str(exc):
                # A cluster node counted offline for now (loaded, or just restarted): placing the
                # stream's copies waits for it, as a group still forming does.
                raise codes.JETSTREAM_UNAVAILABLE(f"{what}: a cluster peer is offline") from exc
            raise _translate(exc, what) from exc
        except (TimeoutError, nats.errors.Error) as exc:
            raise _translate(exc, f"update stream {spec.name} ({', '.join(changed)})") from exc
        log.info("stream updated", stream=spec.name, fields=",".join(changed))
        if "num_replicas" in changed:
            await self._await_replicas(spec.name, spec.replicas)
        return "updated"

    async def _await_replicas(self, name: str, replicas: int, timeout: float = 30.0) -> None:
        """Wait until a stream whose replica count changed has a leader and every new copy has caught
        up: until then the server refuses to create its consumers ("JetStream unavailable")."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                cluster = (await self.js.stream_info(name)).cluster
            except (TimeoutError, nats.errors.Error):
                cluster = None  # no leader to answer yet
            else:
                if replicas <= 1 and (cluster is None or cluster.leader):
                    return
                current = [peer for peer in (cluster.replicas or []) if peer.current] if cluster else []
                if cluster is not None and cluster.leader and len(current) >= replicas - 1:
                    return
            if time.monotonic() >= deadline:
                raise codes.NATS_TIMEOUT(
                    f"stream {name}: {replicas} copies not in step within {timeout:.0f} s"
                )
            await asyncio.sleep(0.1)

    async def ensure_consumer(self, spec: ConsumerSpec) -> str:
        wanted = spec.config()
        try:
            info = await self.js.consumer_info(spec.stream, spec.durable)
        except nats.js.errors.NotFoundError:
            info = None
        except (TimeoutError, nats.errors.Error) as exc:
            raise _translate(exc, f"consumer info {spec.durable}") from exc
        if info is not None and not _differences(info.config, wanted, _CONSUMER_FIELDS):
            return "unchanged"
        try:
            # Creating with the same durable name updates it when the server allows the change.
            await self.js.add_consumer(spec.stream, wanted)
        except (TimeoutError, nats.errors.Error) as exc:
            raise _translate(exc, f"ensure consumer {spec.durable}") from exc
        return "created" if info is None else "updated"

    async def ensure_standard_streams(self, *, replicas: int | None = None) -> None:
        for spec in standard_streams(self.subjects, replicas=replicas):
            await self.ensure_stream(spec)

    async def publish(
        self,
        subject: str,
        payload: bytes,
        *,
        msg_id: str | None = None,
        headers: Mapping[str, str] | None = None,
        timeout: float = 5.0,
    ) -> bool:
        """Publish to JetStream and wait for the ack; returns False when it was a duplicate."""
        all_headers = dict(headers or {})
        if msg_id:
            all_headers[MSG_ID] = msg_id
        try:
            ack = await self.js.publish(subject, payload, timeout=timeout, headers=all_headers or None)
        except (TimeoutError, nats.errors.Error) as exc:
            raise _translate(exc, f"publish {subject}") from exc
        return not ack.duplicate

    async def publish_core(self, subject: str, payload: bytes) -> None:
        try:
            await self.nc.publish(subject, payload)
        except nats.errors.Error as exc:
            raise _translate(exc, f"publish {subject}") from exc

    async def subscribe(
        self, subject: str, handler: Callable[[Any], Awaitable[None]], queue: str = ""
    ) -> Any:
        try:
            return await self.nc.subscribe(subject, queue=queue, cb=handler)
        except nats.errors.Error as exc:
            raise _translate(exc, f"subscribe {subject}") from exc

    async def close(self, timeout: float = 5.0) -> None:
        if self.nc.is_closed:
            return
        self._mark_closing()
        try:
            await asyncio.wait_for(self.nc.drain(), timeout)
        except (TimeoutError, nats.errors.Error):
            await self.nc.close()


class Inbox:
    """Requests whose replies come to one wildcard subscription of the connection's inbox, each
    caller holding its reply's future and bounding its own wait.

    nats-py's ``request`` arms ``asyncio.wait_for`` (a timer, made and cancelled) and draws random
    bytes from the OS for every call. A caller that already watches the deadlines of many requests
    at once (the scheduler's dispatches, bounded by their leases) need not pay for either: here a
    request is a publish and a dict entry. A request nobody serves fails with ``NO_RESPONDERS``, as
    ``RpcClient.call`` does; a reply that comes after its caller gave up is dropped."""

    def __init__(self, bus: Bus) -> None:
        self.bus = bus
        self._prefix = ""
        self._waiting: dict[str, asyncio.Future[Any]] = {}
        # Requests answered more than once: each reply goes to the callback until it is closed.
        self._listening: dict[str, Callable[[Any], None]] = {}
        self._next = 0
        self._sub: Any = None

    def __len__(self) -> int:
        """Requests still waiting for their reply."""
        return len(self._waiting)

    async def start(self) -> None:
        self._prefix = self.bus.nc.new_inbox() + "."
        self._sub = await self.bus.subscribe(self._prefix + "*", self._on_reply)

    async def close(self) -> None:
        if self._sub is not None:
            with contextlib.suppress(nats.errors.Error):
                await self._sub.unsubscribe()
            self._sub = None
        for future in self._waiting.values():
            if not future.done():
                future.set_exception(codes.NATS_UNAVAILABLE("the inbox closed before the reply came"))
        self._waiting.clear()
        listening, self._listening = list(self._listening.values()), {}
        for on_reply in listening:
            on_reply(codes.NATS_UNAVAILABLE("the inbox closed before the replies came"))

    async def request(
        self, subject: str, payload: bytes, *, headers: dict[str, str] | None = None
    ) -> asyncio.Future[Any]:
        """Publish the request; the future of its reply (a nats ``Msg``). Cancel the future, or set
        its exception, to give up on it."""
        assert self._sub is not None, "start the inbox first"
        self._next += 1
        token = str(self._next)
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._waiting[token] = future
        future.add_done_callback(lambda _: self._waiting.pop(token, None))
        try:
            await self.bus.nc.publish(subject, payload, reply=self._prefix + token, headers=headers)
        except BaseException as exc:  # not sent (or the caller cancelled): nothing is left waiting
            del self._waiting[token]
            future.cancel()
            if isinstance(exc, nats.errors.Error):
                raise _translate(exc, f"request {subject}") from exc
            raise
        return future

    async def listen(
        self,
        subject: str,
        payload: bytes,
        on_reply: Callable[[Any], None],
        *,
        headers: dict[str, str] | None = None,
    ) -> Callable[[], None]:
        """Publish a request that may be answered several times: ``on_reply`` gets each reply (a
        nats ``Msg``), or a ``ParleyError`` (``NO_RESPONDERS``; ``NATS_UNAVAILABLE`` when the inbox
        closes), until the returned function is called. Bounding the wait is the caller's."""
        assert self._sub is not None, "start the inbox first"
        self._next += 1
        token = str(self._next)
        self._listening[token] = on_reply
        try:
            await self.bus.nc.publish(subject, payload, reply=self._prefix + token, headers=headers)
        except BaseException as exc:  # not sent (or the caller cancelled): nothing is left listening
            del self._listening[token]
            if isinstance(exc, nats.errors.Error):
                raise _translate(exc, f"request {subject}") from exc
            raise

        def close() -> None:
            self._listening.pop(token, None)

        return close

    async def _on_reply(self, msg: Any) -> None:
        token = msg.subject[len(self._prefix) :]
        future = self._waiting.pop(token, None)
        if future is None:
            on_reply = self._listening.get(token)
            if on_reply is not None:
                if msg.headers and msg.headers.get("Status") == NO_RESPONDERS_STATUS:
                    on_reply(codes.NO_RESPONDERS("nobody serves the request's subject"))
                else:
                    on_reply(msg)
            return
        if future.done():
            return
        if msg.headers and msg.headers.get("Status") == NO_RESPONDERS_STATUS:
            future.set_exception(codes.NO_RESPONDERS("nobody serves the request's subject"))
        else:
            future.set_result(msg)


def _redact_url(url: str) -> str:
    return ",".join(_redact_one(u) for u in url.split(","))


def _redact_one(url: str) -> str:
    if "@" in url:
        scheme, _, rest = url.partition("://")
        return f"{scheme}://***@{rest.split('@', 1)[1]}"
    return url


def _url_user(url: str) -> str | None:
    user = urlsplit(url).username
    return unquote(user) if user else None


def tls_context(ca: Path | None, cert: Path | None = None, key: Path | None = None) -> ssl.SSLContext | None:
    """A client TLS context trusting ``ca`` (and presenting ``cert``/``key`` when given), or None."""
    if ca is None and cert is None:
        return None
    context = ssl.create_default_context(cafile=str(ca) if ca else None)
    if cert is not None:
        context.load_cert_chain(str(cert), str(key) if key else None)
    return context


def _translate(exc: BaseException, what: str) -> ParleyError:
    if isinstance(exc, nats.errors.NoRespondersError):
        return codes.NO_RESPONDERS(f"{what}: no responders")
    if isinstance(exc, (asyncio.TimeoutError, nats.errors.TimeoutError)):
        return codes.NATS_TIMEOUT(f"{what}: timed out")
    if isinstance(
        exc,
        (
            nats.errors.ConnectionClosedError,
            nats.errors.ConnectionDrainingError,
            nats.errors.ConnectionReconnectingError,
            nats.errors.NoServersError,
        ),
    ):
        return codes.NATS_UNAVAILABLE(f"{what}: connection unavailable")
    if isinstance(exc, nats.js.errors.ServiceUnavailableError):
        return codes.JETSTREAM_UNAVAILABLE(f"{what}: JetStream unavailable")
    return codes.NATS_ERROR(f"{what}: {type(exc).__name__}: {exc}")


translate_nats_error = _translate
