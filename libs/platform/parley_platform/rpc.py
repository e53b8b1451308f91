"""Request/reply over NATS carrying the protobuf contract.

Subject ``<ns>.<service>.<Method>``, served in the queue group ``<service>`` so
replicas share the load. Requests and replies are in the envelope of ``frames``: the
request carries the caller's deadline, which bounds the handler; the reply's status
byte says whether the response message or a ``parley.v1.Error`` follows.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import nats.errors
from google.protobuf.message import DecodeError, Message
from nats.aio.msg import Msg

from parley.v1 import common_pb2

from . import codes, frames
from .bus import Bus, translate_nats_error
from .deadlines import DeadlinePassed, Deadlines
from .errors import ParleyError
from .logging import get_logger
from .metrics import MessagingMetrics
from .outage import mark_remote
from .rpcstream import IDLE_SECONDS, StreamHandler, call_stream, serve_stream

log = get_logger(__name__)

Req = TypeVar("Req", bound=Message)
Resp = TypeVar("Resp", bound=Message)
RpcHandler = Callable[[Any], Awaitable[Message]]


class RpcServer:
    def __init__(
        self,
        bus: Bus,
        service: str,
        *,
        metrics: MessagingMetrics | None = None,
        max_concurrency: int = 256,
        stream_idle_seconds: float = IDLE_SECONDS,
    ) -> None:
        self.bus = bus
        self.stream_idle_seconds = stream_idle_seconds
        self.service = service
        self.metrics = metrics
        self._handlers: dict[str, tuple[type[Message], RpcHandler]] = {}
        self._streams: dict[str, tuple[type[Message], StreamHandler]] = {}
        self._subs: list[Any] = []
        self._tasks: set[asyncio.Task[None]] = set()
        self._slots = asyncio.Semaphore(max_concurrency)
        # The callers' deadlines, checked by one timer (``Deadlines``: not one per request).
        self._deadlines = Deadlines()
        # The histogram's child per (method, outcome), found once: ``labels`` locks and hashes.
        self._observers: dict[tuple[str, str], Any] = {}

    def register(
        self, method: str, request_type: type[Req], handler: Callable[[Req], Awaitable[Message]]
    ) -> None:
        self._handlers[method] = (request_type, handler)

    def register_stream(
        self, method: str, request_type: type[Req], handler: Callable[[Req], AsyncIterator[Message]]
    ) -> None:
        """A server-streaming method (see ``rpcstream`` for the protocol)."""
        self._streams[method] = (request_type, handler)

    async def start(self) -> None:
        for method in [*self._handlers, *self._streams]:
            subject = self.bus.subjects.rpc(self.service, method)

            async def on_message(msg: Msg, method: str = method) -> None:
                # Subscription callbacks run one at a time; each request gets its own task.
                await self._slots.acquire()
                serve = self._serve_stream if method in self._streams else self._serve
                task = asyncio.create_task(serve(method, msg))
                self._tasks.add(task)
                task.add_done_callback(self._done)

            self._subs.append(await self.bus.subscribe(subject, on_message, queue=self.service))
        methods = ",".join(sorted([*self._handlers, *self._streams]))
        log.info("rpc serving", service=self.service, methods=methods)

    def _done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        self._slots.release()

    async def _serve(self, method: str, msg: Msg) -> None:
        request_type, handler = self._handlers[method]
        started = time.perf_counter()
        outcome = "ok"
        try:
            try:
                framed = frames.parse_request(msg.data)
            except frames.FrameError as exc:
                raise codes.INVALID_PAYLOAD(
                    f"{method}: the request is {exc}; expected a {request_type.DESCRIPTOR.full_name} in it"
                ) from exc
            try:
                request = request_type.FromString(framed.body)
            except DecodeError as exc:
                raise codes.INVALID_PAYLOAD(
                    f"{method}: request is not a valid {request_type.DESCRIPTOR.full_name}"
                ) from exc
            deadline = framed.deadline
            if deadline is None:
                response = await handler(request)
            else:
                remaining = deadline - time.time()
                if remaining <= 0:
                    raise codes.DEADLINE_EXCEEDED(f"{method}: deadline passed before handling")
                try:
                    response = await self._deadlines.within(remaining, handler(request))
                except DeadlinePassed:
                    raise codes.DEADLINE_EXCEEDED(f"{method}: caller's deadline exceeded") from None
            await self._reply(msg, frames.reply(frames.OK, response.SerializeToString()))
        except ParleyError as exc:
            outcome = exc.code
            await self._fail(msg, exc)
        except TimeoutError:  # a timeout of the handler's own
            outcome = "DEADLINE_EXCEEDED"
            await self._fail(msg, codes.DEADLINE_EXCEEDED(f"{method}: deadline exceeded"))
        except Exception:
            outcome = "INTERNAL"
            log.exception("rpc handler crashed", service=self.service, method=method)
            await self._fail(msg, codes.INTERNAL(f"{method} failed unexpectedly"))
        finally:
            if self.metrics:
                self._observer(method, outcome).observe(time.perf_counter() - started)

    async def _serve_stream(self, method: str, msg: Msg) -> None:
        request_type, handler = self._streams[method]
        started = time.perf_counter()
        outcome = "INTERNAL"
        try:
            outcome = await serve_stream(
                self.bus,
                self.service,
                method,
                request_type,
                handler,
                msg,
                idle_seconds=self.stream_idle_seconds,
            )
        except Exception:
            log.exception("rpc stream crashed", service=self.service, method=method)
        finally:
            if self.metrics:
                self._observer(method, outcome).observe(time.perf_counter() - started)

    def _observer(self, method: str, outcome: str) -> Any:
        observer = self._observers.get((method, outcome))
        if observer is None:
            assert self.metrics is not None
            observer = self.metrics.rpc.labels(f"{self.service}.{method}", outcome)
            self._observers[(method, outcome)] = observer
        return observer

    async def _fail(self, msg: Msg, error: ParleyError) -> None:
        await self._reply(msg, frames.reply(frames.ERROR, error.to_proto().SerializeToString()))

    async def _reply(self, msg: Msg, data: bytes) -> None:
        if not msg.reply:
            return
        with contextlib.suppress(nats.errors.Error):
            await self.bus.nc.publish(msg.reply, data)

    async def stop(self, timeout: float = 10.0) -> None:
        """Stop taking requests, answer the ones already received, wait for those being served."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        subs, self._subs = self._subs, []
        # Drain, not unsubscribe: requests already delivered to this replica but still queued
        # would be dropped unanswered, and their callers would wait out their whole deadline.
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                await asyncio.gather(*(sub.drain() for sub in subs), return_exceptions=True)
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=max(0.0, deadline - loop.time()))


async def _naming_dependency(items: AsyncIterator[Resp], service: str) -> AsyncIterator[Resp]:
    try:
        async for item in items:
            yield item
    except ParleyError as exc:
        mark_remote(exc, service)
        raise
    finally:
        aclose = getattr(items, "aclose", None)
        if aclose is not None:
            await aclose()


class RpcClient:
    def __init__(self, bus: Bus) -> None:
        self.bus = bus

    def stream(
        self,
        service: str,
        method: str,
        request: Message,
        response_type: type[Resp],
        *,
        timeout: float = 60.0,
        idle_timeout: float | None = None,
    ) -> AsyncIterator[Resp]:
        """A server-streaming call's items (see ``rpcstream``); close the iterator to cancel it.
        Like ``call``, a failure because the service is away names it as the missing dependency."""
        items = call_stream(
            self.bus, service, method, request, response_type, timeout=timeout, idle_timeout=idle_timeout
        )
        return _naming_dependency(items, service)

    async def call(
        self, service: str, method: str, request: Message, response_type: type[Resp], *, timeout: float = 10.0
    ) -> Resp:
        subject = self.bus.subjects.rpc(service, method)
        data = frames.request(request.SerializeToString(), deadline=time.time() + timeout)
        try:
            reply = await self.bus.nc.request(subject, data, timeout=timeout)
        except (TimeoutError, nats.errors.Error) as exc:
            if self.bus.denied(subject):
                raise codes.NATS_PERMISSION_DENIED(
                    f"{service}.{method}: the NATS server does not let this identity call it"
                ) from exc
            raise mark_remote(translate_nats_error(exc, f"{service}.{method}"), service) from exc
        try:
            status, body = frames.parse_reply(reply.data)
            if status == frames.ERROR:
                raise mark_remote(ParleyError.from_proto(common_pb2.Error.FromString(body)), service)
            if status != frames.OK:
                raise codes.BAD_REPLY(
                    f"{service}.{method}: a reply with status {frames.STATUS_NAMES[status]}"
                )
            return response_type.FromString(body)
        except frames.FrameError as exc:
            raise codes.BAD_REPLY(f"{service}.{method}: the reply is {exc}") from exc
        except DecodeError as exc:
            raise codes.BAD_REPLY(f"{service}.{method}: reply does not decode") from exc
