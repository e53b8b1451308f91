"""A connector on the bus: send inbound messages, receive replies and stream chunks, cancel turns.

A connector publishes a platform's messages on its agent's inbound subject for its source (with
``Nats-Msg-Id`` ``<source>:<message_id>``, so JetStream drops a repeat within its duplicate
window), and reads the agent's replies for that source through its own durable pull consumer on
the OUTBOUND stream: replies produced while it is down wait there and are delivered when it comes
back, once each it acknowledges. Stream chunks are core NATS (best effort), cancellation a core
request served by the runtime.

One connector identity serves one agent and one source (``Connector.connect(creds)``). A service
serving several agents under its own NATS identity (the web connector) passes ``agent_ids=None``
(every agent: the filter ``<ns>.outbound.*.<source>``) or a list of agent ids, with its own
durable name.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Literal

import nats.errors
import nats.js.errors
from google.protobuf.message import DecodeError
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from parley.v1 import common_pb2, runtime_pb2
from parley_platform import codes as platform_codes
from parley_platform.bus import Bus, Subjects, translate_nats_error
from parley_platform.errors import ParleyError
from parley_platform.logging import get_logger
from parley_platform.retry import Backoff

from . import codes
from .credentials import Credentials
from .messages import Chunk, Inbound, Reply

log = get_logger(__name__)

STATUS = "Parley-Status"  # a cancel answer's header when it is an error (a parley.v1.Error)
SEND_BACKOFF = Backoff(base=0.2, cap=5.0)
CHUNK_BUFFER = 10_000


@dataclass(frozen=True)
class Cancelled:
    cancelled: bool  # False: the turn had already finished, or was not running
    turn_id: str


class Connector:
    """See the module docstring. Use ``await Connector.connect(creds)`` for a connector identity,
    or ``await Connector(bus, source=..., agent_ids=..., durable=...).start()`` on a connection
    of one's own."""

    def __init__(
        self,
        bus: Bus | Client,
        *,
        source: str,
        agent_ids: Sequence[str] | None,
        durable: str,
        namespace: str = "parley",
        deliver: Literal["new", "all"] = "new",
        ack_wait: float = 30.0,
        publish_timeout: float = 5.0,
        owns_bus: bool = False,
        forget_after: float | None = None,
    ) -> None:
        if not source or any(c in source for c in ".*> "):
            raise platform_codes.INVALID_ARGUMENT(f"source {source!r} must be one subject token")
        if agent_ids is not None and (not agent_ids or any(not a or "." in a for a in agent_ids)):
            raise platform_codes.INVALID_ARGUMENT("agent_ids must be None (every agent) or agent ids")
        self.bus = bus if isinstance(bus, Bus) else Bus(bus, Subjects(namespace))
        self.subjects = self.bus.subjects
        self.source = source
        self.agent_ids = list(agent_ids) if agent_ids is not None else None
        self.durable = durable
        self.stream = self.subjects.stream("OUTBOUND")
        self.deliver = deliver
        # None: the consumer stays while nobody reads it (a connector's replies wait for it); else
        # the server removes it after that many seconds without a reader (the terminal's).
        self.forget_after = forget_after
        self.ack_wait = ack_wait
        self.publish_timeout = publish_timeout
        self._owns_bus = owns_bus
        self._closed = False
        self._chunk_streams: set[Chunks] = set()
        # One pull subscription for every replies() iterator: a reply answering the pull request of
        # an iterator cancelled mid-fetch lands in its queue, where the next fetch takes it first,
        # instead of in a closed inbox until the consumer's ack_wait.
        self._pull: JetStreamContext.PullSubscription | None = None
        self._fetching = asyncio.Lock()

    # --- setting up -------------------------------------------------------------------------------

    @classmethod
    async def connect(
        cls,
        creds: Credentials,
        *,
        agent_ids: Sequence[str] | None = (),
        durable: str = "",
        connect_timeout: float = 5.0,
        deliver: Literal["new", "all"] = "new",
        ack_wait: float = 30.0,
        publish_timeout: float = 5.0,
    ) -> Connector:
        """Connected to NATS as the connector in ``creds`` (its user, password and inbox prefix),
        its durable consumer ensured. ``agent_ids`` defaults to the credentials' agent. ``deliver``
        and ``ack_wait`` (seconds before an unacknowledged reply comes again) apply to a consumer
        created now; ``publish_timeout`` bounds each publish and JetStream API call."""
        bus = await Bus.connect(
            creds.nats_url,
            name=f"connector-{creds.name}",
            namespace=creds.namespace,
            connect_timeout=connect_timeout,
            user=creds.user,
            password=creds.password,
            inbox=creds.inbox_prefix,
        )
        try:
            connector = cls(
                bus,
                source=creds.source,
                agent_ids=[creds.agent_id] if agent_ids == () else agent_ids,
                durable=durable or creds.durable,
                deliver=deliver,
                ack_wait=ack_wait,
                publish_timeout=publish_timeout,
                owns_bus=True,
            )
            return await connector.start()
        except BaseException:
            await bus.close()
            raise

    def outbound_filters(self) -> list[str]:
        agents = self.agent_ids if self.agent_ids is not None else ["*"]
        return [self.subjects.outbound(agent, self.source) for agent in agents]

    def stream_subjects(self) -> list[str]:
        agents = self.agent_ids if self.agent_ids is not None else ["*"]
        return [f"{self.subjects.ns}.stream.{agent}.{self.source}" for agent in agents]

    async def start(self) -> Connector:
        """Ensure the durable consumer, so replies from now on wait for this connector."""
        filters = self.outbound_filters()
        config = ConsumerConfig(
            name=self.durable,
            durable_name=self.durable,
            ack_policy=AckPolicy.EXPLICIT,
            deliver_policy=DeliverPolicy.NEW if self.deliver == "new" else DeliverPolicy.ALL,
            ack_wait=self.ack_wait,
            inactive_threshold=self.forget_after,
            filter_subject=filters[0] if len(filters) == 1 else None,
            filter_subjects=filters if len(filters) > 1 else None,
        )
        js = self.bus.js
        try:
            info = await js.consumer_info(self.stream, self.durable, timeout=self.publish_timeout)
        except nats.js.errors.NotFoundError:
            info = None
        except (TimeoutError, nats.errors.Error) as exc:
            raise self._refused(exc, f"$JS.API.CONSUMER.INFO.{self.stream}.{self.durable}") from exc
        live = None
        if info is not None:
            live = info.config.filter_subjects or [info.config.filter_subject]
        if live is None or sorted(x for x in live if x) != sorted(filters):
            try:
                await js.add_consumer(self.stream, config, timeout=self.publish_timeout)
            except nats.js.errors.NotFoundError as exc:
                raise platform_codes.NATS_ERROR(
                    f"the stream {self.stream} does not exist: is the runtime running?"
                ) from exc
            except (TimeoutError, nats.errors.Error) as exc:
                subject = f"$JS.API.CONSUMER.CREATE.{self.stream}.{self.durable}"
                if len(filters) == 1:
                    subject += f".{filters[0]}"
                raise self._refused(exc, subject) from exc
        return self

    def _refused(self, exc: BaseException, subject: str) -> ParleyError:
        if self.bus.denied(subject):
            return platform_codes.NATS_PERMISSION_DENIED(
                f"the NATS server refused this identity {subject}: not in its permissions"
            )
        return translate_nats_error(exc, subject)

    def _agent_for(self, agent_id: str) -> str:
        if agent_id:
            if self.agent_ids is not None and agent_id not in self.agent_ids:
                raise platform_codes.INVALID_ARGUMENT(f"this connector does not serve agent {agent_id}")
            return agent_id
        if self.agent_ids is not None and len(self.agent_ids) == 1:
            return self.agent_ids[0]
        raise platform_codes.INVALID_ARGUMENT(
            "this connector serves several agents: name the agent (agent_id)"
        )

    def _check_open(self) -> None:
        if self._closed:
            raise codes.CONNECTOR_CLOSED("the connector is closed")

    # --- sending ----------------------------------------------------------------------------------

    async def send(self, message: Inbound, *, retry_for: float | None = None) -> bool:
        """Publish ``message`` and wait for JetStream's ack. True when new, False when JetStream
        already had this message id (a repeat: the agent sees it once). While NATS or JetStream
        is unreachable it retries with the same id (so nothing doubles) for ``retry_for`` seconds
        (None: until it succeeds), then raises SEND_GAVE_UP."""
        self._check_open()
        agent_id = self._agent_for(message.agent_id)
        payload = message.to_proto(agent_id, self.source).SerializeToString()
        subject = self.subjects.inbound(agent_id, self.source)
        msg_id = f"{self.source}:{message.message_id}"
        deadline = None if retry_for is None else time.monotonic() + retry_for
        attempt = 0
        while True:
            try:
                return await self.bus.publish(subject, payload, msg_id=msg_id, timeout=self.publish_timeout)
            except ParleyError as exc:
                if self.bus.denied(subject):
                    raise platform_codes.NATS_PERMISSION_DENIED(
                        f"the NATS server does not let this identity publish to {subject}"
                    ) from exc
                if not exc.retryable or self._closed:
                    raise
                attempt += 1
                delay = SEND_BACKOFF.delay(attempt)
                if deadline is not None and time.monotonic() + delay > deadline:
                    raise codes.SEND_GAVE_UP(
                        f"message {message.message_id} not published after {attempt} attempts ({exc.code})"
                    ) from exc
                log.warning(
                    "inbound publish failed, retrying",
                    subject=subject,
                    message_id=message.message_id,
                    attempt=attempt,
                    error=exc.code,
                )
                await asyncio.sleep(delay)

    # --- receiving --------------------------------------------------------------------------------

    async def replies(self, *, poll: float = 2.0) -> AsyncIterator[Reply]:
        """The agent's replies for this source, through the durable consumer, oldest first; each
        comes again (``deliveries`` > 1) until ``ack()``ed. A payload that is not an
        OutboundMessage is logged and terminated, never yielded. Ends when the connector closes."""
        self._check_open()
        while not self._closed:
            try:
                async with self._fetching:
                    if self._pull is None:
                        self._pull = await self.bus.js.pull_subscribe_bind(self.durable, self.stream)
                    [msg] = await self._pull.fetch(1, timeout=poll)
            except (TimeoutError, nats.errors.TimeoutError):
                continue
            except nats.errors.Error as exc:
                if self._closed or self.bus.nc.is_closed:
                    return
                log.warning("reply fetch failed", consumer=self.durable, error=type(exc).__name__)
                await asyncio.sleep(0.5)
                continue
            reply = await self._decode_reply(msg)
            if reply is not None:
                yield reply

    async def _decode_reply(self, msg: Msg) -> Reply | None:
        try:
            outbound = runtime_pb2.OutboundMessage.FromString(msg.data)
        except DecodeError:
            outbound = None
        meta = msg.metadata
        if outbound is None or not outbound.response_id:
            log.warning(
                "malformed reply terminated",
                subject=msg.subject,
                consumer=self.durable,
                sequence=meta.sequence.stream,
                size=len(msg.data),
            )
            await msg.term()
            return None

        async def ack() -> None:
            try:
                await msg.ack()
            except nats.errors.Error as exc:
                raise translate_nats_error(exc, f"ack reply {outbound.response_id}") from exc

        async def nak(delay: float) -> None:
            try:
                await msg.nak(delay=delay)
            except nats.errors.Error as exc:
                raise translate_nats_error(exc, f"nak reply {outbound.response_id}") from exc

        return Reply.from_proto(outbound, deliveries=meta.num_delivered, _ack=ack, _nak=nak)

    def chunks(self) -> Chunks:
        """The stream chunks of this connector's agents and source, as they are published. Iterate
        it (it subscribes on the first step) or enter it (``async with conn.chunks() as chunks``)
        to subscribe before sending, so no early chunk is missed."""
        self._check_open()
        return Chunks(self)

    # --- cancelling -------------------------------------------------------------------------------

    async def cancel(
        self,
        *,
        message_id: str = "",
        turn_id: str = "",
        agent_id: str = "",
        reason: str = "",
        timeout: float = 5.0,
    ) -> Cancelled:
        """Cancel the turn started by this source's message ``message_id``, or the turn ``turn_id``.
        Raises CANCEL_UNSERVED at once when nothing serves the cancel subject."""
        self._check_open()
        if not message_id and not turn_id:
            raise platform_codes.INVALID_ARGUMENT("cancel needs message_id or turn_id")
        agent = self._agent_for(agent_id)
        subject = f"{self.subjects.ns}.cancel.{agent}.{self.source}"
        request = runtime_pb2.CancelTurnRequest(
            agent_id=agent, turn_id=turn_id, source=self.source, message_id=message_id, reason=reason
        )
        try:
            answer = await self.bus.nc.request(subject, request.SerializeToString(), timeout=timeout)
        except nats.errors.NoRespondersError:
            raise codes.CANCEL_UNSERVED(f"nothing serves {subject}") from None
        except (TimeoutError, nats.errors.Error) as exc:
            raise self._refused(exc, subject) from exc
        try:
            if (answer.headers or {}).get(STATUS) == "error":
                raise ParleyError.from_proto(common_pb2.Error.FromString(answer.data))
            response = runtime_pb2.CancelTurnResponse.FromString(answer.data)
        except DecodeError as exc:
            raise platform_codes.NATS_ERROR(f"the answer on {subject} does not decode") from exc
        return Cancelled(response.cancelled, response.turn_id)

    # --- closing ----------------------------------------------------------------------------------

    async def close(self) -> None:
        """Stop receiving; with a connection of its own (``connect``), drain and close it, so
        every acknowledgement sent reaches the server."""
        if self._closed:
            return
        self._closed = True
        for stream in list(self._chunk_streams):
            await stream.aclose()
        if self._pull is not None and not self.bus.nc.is_closed:
            with contextlib.suppress(nats.errors.Error):
                await self._pull.unsubscribe()
        if self._owns_bus:
            await self.bus.close()

    async def __aenter__(self) -> Connector:
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.close()


_END = object()


class Chunks:
    """An async iterator of ``Chunk`` over a core NATS subscription (see ``Connector.chunks``)."""

    def __init__(self, connector: Connector) -> None:
        self._connector = connector
        self._queue: asyncio.Queue[object] = asyncio.Queue()
        self._subs: list[Subscription] = []
        self._started = False
        self._dropped = 0

    async def start(self) -> Chunks:
        if self._started:
            return self
        self._started = True
        self._connector._chunk_streams.add(self)
        for subject in self._connector.stream_subjects():
            self._subs.append(await self._connector.bus.subscribe(subject, self._on_chunk))
        await self._connector.bus.nc.flush()
        return self

    async def _on_chunk(self, msg: Msg) -> None:
        try:
            chunk = Chunk.from_proto(runtime_pb2.StreamChunk.FromString(msg.data))
        except DecodeError:
            log.warning("malformed stream chunk skipped", subject=msg.subject, size=len(msg.data))
            return
        if self._queue.qsize() >= CHUNK_BUFFER:
            self._dropped += 1  # nobody reads: chunks are best effort, the complete reply still comes
            return
        self._queue.put_nowait(chunk)

    async def aclose(self) -> None:
        self._connector._chunk_streams.discard(self)
        subs, self._subs = self._subs, []
        for sub in subs:
            with contextlib.suppress(nats.errors.Error):
                await sub.unsubscribe()
        self._queue.put_nowait(_END)

    def __aiter__(self) -> Chunks:
        return self

    async def __anext__(self) -> Chunk:
        if not self._started:
            await self.start()
        item = await self._queue.get()
        if item is _END:
            self._queue.put_nowait(_END)
            raise StopAsyncIteration
        assert isinstance(item, Chunk)
        return item

    async def __aenter__(self) -> Chunks:
        return await self.start()

    async def __aexit__(self, *_: object) -> None:
        await self.aclose()
