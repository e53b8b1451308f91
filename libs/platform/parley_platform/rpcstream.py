"""Server-streaming calls over NATS: the streamed counterpart of ``rpc``'s request/reply.

The caller picks a stream id and subscribes to its own stream inbox
``_INBOX.<identity>.stream.<id>``, then publishes the request on ``<ns>.<service>.<Method>`` with
that inbox as reply subject and the id in the request's envelope (``frames``; one replica of the
queue group takes it). The server answers on the inbox, every message led by a status byte:

- ``open`` (empty): the stream is being served; sent at once, before the first item;
- ``ok``: one item (the method's response message);
- ``items``: several items that were ready together, each a 4-byte big-endian length and the
  item's bytes (only to a caller whose request has the ``BATCH`` flag; a handler that yields
  without waiting, like a model answering at once, costs one message instead of one per item);
- ``end`` (empty): the last message of a completed stream;
- ``last``: items as in ``items`` (perhaps none), then the end: the stream's last message;
- ``error``: a ``parley.v1.Error`` envelope; the stream is over.

A caller whose request also has the ``LAST`` flag takes a stream whose last items and end come
in one ``last`` message, and whose ``open`` comes only when the handler has no item ready at once:
a handler that answers at once (the scripted model; a cached answer) costs one message in all
instead of three, and the caller's first message, whatever it is, says the stream is served.

The caller controls the stream on ``<ns>.<service>.stream.<id>``, which every replica of the
service hears through one subscription (``<ns>.<service>.stream.*``) and the serving one acts on:
``ping`` every ``HEARTBEAT_SECONDS`` while it reads, and ``cancel`` when it stops reading before
the end (it closed the iterator, or its task was cancelled). The server cancels the handler's
task, so the handler (a model provider's generator) sees ``CancelledError`` where it waits, when a
cancel arrives, when no ping came for ``idle_seconds`` (the caller crashed or lost NATS), or when
the caller's deadline (in the request's envelope) passes. The caller gives up, with
``DEADLINE_EXCEEDED``, when nothing arrives for its idle timeout or its deadline passes.

Neither side subscribes per stream: a connection has one subscription for all its streams'
items (``<inbox>.stream.*``) and one per service it serves for their control messages, each routing
by the stream id (a subscription costs both client and server a round of bookkeeping, and streams
are as frequent as turns).
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any, TypeVar

import nats.errors
from google.protobuf.message import DecodeError, Message
from nats.aio.msg import Msg

from parley.v1 import common_pb2

from . import codes, frames
from .bus import Bus, translate_nats_error
from .errors import ParleyError
from .logging import get_logger

log = get_logger(__name__)

BATCH_BYTES = 64 * 1024  # well under NATS's smallest usual max_payload (1 MiB)
OPEN, OK, ITEMS, END, ERROR, LAST = (
    frames.OPEN,
    frames.OK,
    frames.ITEMS,
    frames.END,
    frames.ERROR,
    frames.LAST_ITEMS,
)
PING, CANCEL = b"ping", b"cancel"
HEARTBEAT_SECONDS = 2.0
IDLE_SECONDS = 10.0  # the server's patience without a ping: five heartbeats
_STREAM_ID = re.compile(r"^[A-Za-z0-9_-]{1,64}$")

Resp = TypeVar("Resp", bound=Message)
StreamHandler = Callable[[Any], AsyncIterator[Message]]


def control_subject(bus: Bus, service: str, stream_id: str) -> str:
    return bus.subjects.rpc(service, f"stream.{stream_id}")


def stream_inbox(bus: Bus) -> tuple[str, str]:
    """A fresh (stream id, inbox) under the caller's ``<inbox prefix>.stream``."""
    prefix, stream_id = bus.nc.new_inbox().rsplit(".", 1)
    return stream_id, f"{prefix}.stream.{stream_id}"


class Router:
    """One subscription on ``<prefix>.*`` for many streams, each message handed to the route named
    by its last token; a message for no route (a stream already over, another replica's) is
    dropped. Made once per connection and subject (``router``)."""

    def __init__(self, bus: Bus, prefix: str) -> None:
        self.bus = bus
        self.prefix = prefix
        self.routes: dict[str, Callable[[Msg], Awaitable[None]]] = {}
        self._subscription: Any = None
        self._subscribing = asyncio.Lock()

    async def add(self, key: str, handler: Callable[[Msg], Awaitable[None]]) -> None:
        """Route ``<prefix>.<key>`` to ``handler``; returns once the subscription is in place."""
        self.routes[key] = handler
        if self._subscription is not None:
            return
        try:
            async with self._subscribing:
                if self._subscription is None:
                    self._subscription = await self.bus.subscribe(f"{self.prefix}.*", self._on)
        except BaseException:
            self.routes.pop(key, None)
            raise

    def remove(self, key: str) -> None:
        self.routes.pop(key, None)

    async def _on(self, msg: Msg) -> None:
        handler = self.routes.get(msg.subject.rpartition(".")[2])
        if handler is not None:
            await handler(msg)


_routers: weakref.WeakKeyDictionary[Bus, dict[str, Router]] = weakref.WeakKeyDictionary()


def router(bus: Bus, prefix: str) -> Router:
    """The connection's router for ``<prefix>.*``."""
    routers = _routers.setdefault(bus, {})
    found = routers.get(prefix)
    if found is None:
        found = routers[prefix] = Router(bus, prefix)
    return found


async def serve_stream(
    bus: Bus,
    service: str,
    method: str,
    request_type: type[Message],
    handler: StreamHandler,
    msg: Msg,
    *,
    idle_seconds: float = IDLE_SECONDS,
) -> str:
    """Serve one streamed call; returns its outcome (``ok``, ``CANCELLED``, an error code)."""
    reply = msg.reply
    if not reply:
        return "INVALID_ARGUMENT"  # nowhere to answer
    try:
        framed = frames.parse_request(msg.data)
    except frames.FrameError as exc:
        expected = request_type.DESCRIPTOR.full_name
        error = codes.INVALID_PAYLOAD(f"{method}: the request is {exc}; expected a {expected} in it")
        await _send(bus, reply, ERROR, error)
        return error.code
    stream_id = framed.stream_id
    if not _STREAM_ID.match(stream_id):
        await _send(bus, reply, ERROR, codes.INVALID_ARGUMENT(f"{method}: stream id missing or invalid"))
        return "INVALID_ARGUMENT"
    try:
        request = request_type.FromString(framed.body)
    except DecodeError:
        error = codes.INVALID_PAYLOAD(f"{method}: request is not a valid {request_type.DESCRIPTOR.full_name}")
        await _send(bus, reply, ERROR, error)
        return error.code
    loop = asyncio.get_running_loop()
    deadline = framed.deadline
    heard = loop.time()
    cancelled = asyncio.Event()

    async def on_control(control: Msg) -> None:
        nonlocal heard
        heard = loop.time()
        if control.data == CANCEL:
            cancelled.set()

    controls = router(bus, control_subject(bus, service, "").rstrip("."))
    await controls.add(stream_id, on_control)
    if framed.batch:
        # With LAST, the pump says ``open`` itself, only if no item is ready at once.
        if not framed.last:
            await _send(bus, reply, OPEN)
        pump = asyncio.create_task(_pump_batches(bus, reply, handler(request), method, last=framed.last))
    else:
        await _send(bus, reply, OPEN)
        pump = asyncio.create_task(_pump(bus, reply, handler(request), method))
    stop = asyncio.create_task(cancelled.wait())
    try:
        while not pump.done():
            now = loop.time()
            budget = heard + idle_seconds - now
            if deadline is not None:
                budget = min(budget, deadline - time.time())
            if cancelled.is_set() or budget <= 0:
                break
            await asyncio.wait({pump, stop}, timeout=budget, return_when=asyncio.FIRST_COMPLETED)
        if pump.done():
            return pump.result()
        pump.cancel()
        await asyncio.wait({pump})
        if cancelled.is_set():
            return "CANCELLED"
        if deadline is not None and deadline <= time.time():
            await _send(bus, reply, ERROR, codes.DEADLINE_EXCEEDED(f"{method}: caller's deadline exceeded"))
            return "DEADLINE_EXCEEDED"
        log.info("stream abandoned: its caller stopped pinging", method=method, stream=stream_id)
        return "ABANDONED"
    except asyncio.CancelledError:
        pump.cancel()
        await asyncio.wait({pump})
        raise
    finally:
        stop.cancel()
        controls.remove(stream_id)


async def _pump(bus: Bus, reply: str, items: AsyncIterator[Message], method: str) -> str:
    try:
        async with contextlib.aclosing(items):  # type: ignore[type-var]
            async for item in items:
                await _publish(bus, reply, item.SerializeToString(), OK)
        await _send(bus, reply, END)
        return "ok"
    except ParleyError as exc:
        await _send(bus, reply, ERROR, exc)
        return exc.code
    except Exception:
        log.exception("stream handler crashed", method=method)
        await _send(bus, reply, ERROR, codes.INTERNAL(f"{method} failed unexpectedly"))
        return "INTERNAL"


async def _pump_batches(
    bus: Bus, reply: str, items: AsyncIterator[Message], method: str, *, last: bool = False
) -> str:
    """``_pump`` for a caller that takes batches: the handler runs in a task of its own, and what
    it has yielded by the time the previous message is sent goes in one message. Nothing waits to
    fill a batch, so an item is never later than it would be alone. With ``last`` (the caller
    takes ``last``): ``open`` only when the handler's first run left nothing ready, and the items
    that come with the end go in one ``last`` message."""
    ready: asyncio.Queue[Message | BaseException | None] = asyncio.Queue()

    async def produce() -> None:
        try:
            async with contextlib.aclosing(items):  # type: ignore[type-var]
                async for item in items:
                    ready.put_nowait(item)
        except ParleyError as exc:
            ready.put_nowait(exc)
        except Exception as exc:
            log.exception("stream handler crashed", method=method)
            ready.put_nowait(exc)
        else:
            ready.put_nowait(None)

    producer = asyncio.create_task(produce())
    try:
        if last:
            await asyncio.sleep(0)  # the handler's first run: one that answers at once has answered
            if ready.empty():
                await _send(bus, reply, OPEN)
        while True:
            pending = [await ready.get()]
            while isinstance(pending[-1], Message) and not ready.empty():
                pending.append(ready.get_nowait())
            final = pending[-1]
            ready_items = [item.SerializeToString() for item in pending if isinstance(item, Message)]
            if final is None and last:
                await _publish_items(bus, reply, ready_items, ending=True)
                return "ok"
            await _publish_items(bus, reply, ready_items)
            if isinstance(final, Message):
                continue
            if final is None:
                await _send(bus, reply, END)
                return "ok"
            error = (
                final if isinstance(final, ParleyError) else codes.INTERNAL(f"{method} failed unexpectedly")
            )
            await _send(bus, reply, ERROR, error)
            return error.code
    finally:
        if not producer.done():
            producer.cancel()
            await asyncio.wait({producer})


async def _publish_items(bus: Bus, reply: str, items: list[bytes], *, ending: bool = False) -> None:
    """Items as ``ok`` messages when alone, else as ``items`` batches of up to ``BATCH_BYTES``;
    ``ending``: the last batch (perhaps empty) is a ``last`` message, the stream's end."""
    batch: list[bytes] = []
    size = 0
    for data in [*items, None]:
        if data is None and ending:
            await _publish(bus, reply, b"".join(_framed(item) for item in batch), LAST)
            return
        if batch and (data is None or size + 4 + len(data) > BATCH_BYTES):
            if len(batch) == 1:
                await _publish(bus, reply, batch[0], OK)
            else:
                await _publish(bus, reply, b"".join(_framed(item) for item in batch), ITEMS)
            batch, size = [], 0
        if data is not None:
            batch.append(data)
            size += 4 + len(data)


def _framed(data: bytes) -> bytes:
    return len(data).to_bytes(4, "big") + data


def _unframed(data: bytes) -> Iterator[bytes]:
    at = 0
    while at < len(data):
        size = int.from_bytes(data[at : at + 4], "big")
        if at + 4 + size > len(data):
            raise ValueError("an item runs past the end of its batch")
        yield data[at + 4 : at + 4 + size]
        at += 4 + size


async def _send(bus: Bus, reply: str, status: int, error: ParleyError | None = None) -> None:
    await _publish(bus, reply, error.to_proto().SerializeToString() if error else b"", status)


async def _publish(bus: Bus, subject: str, data: bytes, status: int) -> None:
    with contextlib.suppress(nats.errors.Error):
        await bus.nc.publish(subject, frames.reply(status, data))


async def call_stream(
    bus: Bus,
    service: str,
    method: str,
    request: Message,
    response_type: type[Resp],
    *,
    timeout: float,
    idle_timeout: float | None = None,
) -> AsyncIterator[Resp]:
    """The items of a streamed call, as they arrive. Stopping early (``aclose``, cancellation)
    cancels the call on the server. ``timeout`` bounds the whole stream, ``idle_timeout`` (default:
    ``timeout``) the wait for each message."""
    what = f"{service}.{method}"
    subject = bus.subjects.rpc(service, method)
    stream_id, inbox = stream_inbox(bus)
    control = control_subject(bus, service, stream_id)
    queue: asyncio.Queue[Msg] = asyncio.Queue()

    async def on_message(msg: Msg) -> None:
        queue.put_nowait(msg)

    loop = asyncio.get_running_loop()
    ends = loop.time() + timeout
    idle = timeout if idle_timeout is None else idle_timeout
    finished = opened = False
    heartbeat: asyncio.Task[None] | None = None
    inboxes = router(bus, inbox.rpartition(".")[0])
    await inboxes.add(stream_id, on_message)
    try:
        data = frames.request(
            request.SerializeToString(),
            deadline=time.time() + timeout,
            stream_id=stream_id,
            batch=True,
            last=True,
        )
        try:
            await bus.nc.publish(subject, data, reply=inbox)
        except nats.errors.Error as exc:
            raise translate_nats_error(exc, what) from exc
        while True:
            wait = min(ends - loop.time(), idle)
            try:
                async with asyncio.timeout(max(wait, 0)):
                    msg = await queue.get()
            except TimeoutError as exc:
                if bus.denied(subject):
                    raise codes.NATS_PERMISSION_DENIED(
                        f"{what}: the NATS server does not let this identity call it"
                    ) from exc
                raise codes.DEADLINE_EXCEEDED(
                    f"{what}: {'no answer' if not opened else 'the stream went quiet'} within {wait:.1f}s"
                ) from exc
            if not msg.data and (msg.headers or {}).get("Status") == "503":  # the server's own
                finished = True
                raise codes.NO_RESPONDERS(f"{what}: no replica serves it")
            try:
                status, body = frames.parse_reply(msg.data)
            except frames.FrameError as exc:
                raise codes.BAD_REPLY(f"{what}: a streamed message is {exc}") from exc
            if status in (OPEN, OK, ITEMS) and not opened:  # served, and not over yet: keep it alive
                opened = True
                heartbeat = asyncio.create_task(_heartbeat(bus, control))
            if status == OK:
                try:
                    item = response_type.FromString(body)
                except DecodeError as exc:
                    raise codes.BAD_REPLY(f"{what}: a streamed item does not decode") from exc
                yield item
            elif status in (ITEMS, LAST):
                finished = status == LAST
                for item in _batch_of(body, response_type, what):
                    yield item
                if finished:
                    return
            elif status == END:
                finished = True
                return
            elif status == ERROR:
                finished = True
                try:
                    error = common_pb2.Error.FromString(body)
                except DecodeError as exc:
                    raise codes.BAD_REPLY(f"{what}: an error does not decode") from exc
                raise ParleyError.from_proto(error)
            elif status != OPEN:  # frames.parse_reply admits no other status
                raise codes.BAD_REPLY(f"{what}: a streamed message with status {status}")
    finally:
        if heartbeat is not None:
            heartbeat.cancel()
        inboxes.remove(stream_id)
        if not finished:
            with contextlib.suppress(nats.errors.Error):
                await bus.nc.publish(control, CANCEL)


def _batch_of(body: bytes, response_type: type[Resp], what: str) -> list[Resp]:
    try:
        return [response_type.FromString(data) for data in _unframed(body)]
    except (DecodeError, ValueError) as exc:
        raise codes.BAD_REPLY(f"{what}: a batch of streamed items does not decode") from exc


async def _heartbeat(bus: Bus, control: str) -> None:
    with contextlib.suppress(nats.errors.Error):
        while True:
            await asyncio.sleep(HEARTBEAT_SECONDS)
            await bus.nc.publish(control, PING)
