"""The pull-consumer loop: explicit ack, backoff, max_deliver, dead letters.

A handler returns normally → ack. It raises ``Poison`` → the message goes to
the dead-letter stream with the reason and is terminated. It fails because a
dependency is unavailable (``parley_platform.outage``) → the message is held
without spending a delivery and the consumer stops fetching until the
dependency is back, however long that takes. Anything else → it is nak'ed with
a delay growing with its delivery count, and on the last allowed delivery it is
dead-lettered instead. Cancellation never acks: the message is redelivered
after ``ack_wait``.

A process that dies holding a message's last allowed delivery never gets to
dead-letter it; JetStream then announces the message with a max-deliveries
advisory. One replica of the consumer (a queue group) takes the advisory, reads
the message from the stream, dead-letters it and tells the service
(``on_exhausted``), so nothing is left half-done without a record.

A fetch from a consumer that no longer exists (its stream was deleted and
created again) just times out, like an idle one. So an idle consumer checks
every ``check_interval`` seconds that it still exists, and creates and binds
it again (and the stream, when it is one of the suite's standard streams)
instead of waiting forever. Each delivery carries the stream's epoch (its
creation time): sequence numbers start again in a new stream, and (epoch,
sequence) still orders every message a service has seen.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Any

import nats.errors
import nats.js.errors
from nats.aio.msg import Msg

from .bus import MSG_ID, Bus, ConsumerSpec, standard_streams, translate_nats_error
from .errors import Kind, ParleyError
from .logging import get_logger
from .metrics import MessagingMetrics
from .outage import Dependencies, outage_of
from .retry import Backoff

log = get_logger(__name__)

DEAD_REASON = "Parley-Dead-Reason"
DEAD_STREAM = "Parley-Dead-Stream"
DEAD_SUBJECT = "Parley-Dead-Subject"
DEAD_SEQUENCE = "Parley-Dead-Sequence"
DEAD_DELIVERIES = "Parley-Dead-Deliveries"
DEAD_CONSUMER = "Parley-Dead-Consumer"
DEAD_MSG_ID = "Parley-Dead-Msg-Id"  # the original Nats-Msg-Id: a replay publishes under it again


class Poison(Exception):
    """The message can never be handled: dead-letter it with this reason."""

    def __init__(self, reason: str, *, label: str = "invalid") -> None:
        super().__init__(reason)
        self.reason = reason
        self.label = label


@dataclass
class Delivery:
    """One message as a handler sees it."""

    msg: Msg
    subject: str
    data: bytes
    headers: dict[str, str]
    num_delivered: int
    stream_sequence: int
    msg_id: str
    stream_epoch: int = 0  # microseconds since 1970 at which the stream was created
    retries: int = 0  # handled again in this process after a dependency came back (no delivery spent)

    @property
    def redelivered(self) -> bool:
        """Handled before (another delivery, or a retry after an outage): earlier work may exist."""
        return self.num_delivered > 1 or self.retries > 0

    @property
    def position(self) -> tuple[int, int]:
        """Where the message stands among every message of the stream's name, old streams included."""
        return (self.stream_epoch, self.stream_sequence)

    async def in_progress(self) -> None:
        """Tell the server the work goes on, resetting its ack timer."""
        with contextlib.suppress(nats.errors.Error):
            await self.msg.in_progress()


Handler = Callable[[Delivery], Awaitable[None]]
# (subject, data, stream sequence) of a message whose every allowed delivery went unanswered.
Exhausted = Callable[[str, bytes, int], Awaitable[None]]
MAX_DELIVERIES_ADVISORY = "$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.{stream}.{consumer}"


PERMANENT_KINDS = frozenset(
    {
        Kind.INVALID_ARGUMENT,
        Kind.NOT_FOUND,
        Kind.FAILED_PRECONDITION,
        Kind.PERMISSION_DENIED,
        Kind.UNAUTHENTICATED,
    }
)


def is_permanent(exc: BaseException) -> bool:
    """A failure that no retry can fix: it is dead-lettered at once instead of redelivered."""
    return isinstance(exc, ParleyError) and not exc.retryable and exc.kind in PERMANENT_KINDS


class PullConsumer:
    def __init__(
        self,
        bus: Bus,
        spec: ConsumerSpec,
        handler: Handler,
        *,
        concurrency: int = 64,
        batch: int = 64,
        metrics: MessagingMetrics | None = None,
        backoff_base: float = 0.5,
        backoff_cap: float = 30.0,
        fetch_timeout: float = 1.0,
        on_exhausted: Exhausted | None = None,
        check_interval: float = 5.0,
        dependencies: Dependencies | None = None,
    ) -> None:
        self.bus = bus
        self.dependencies = dependencies or Dependencies()
        self.on_exhausted = on_exhausted
        self.check_interval = check_interval
        self.stream_epoch = 0
        self.spec = spec
        self.handler = handler
        self.concurrency = concurrency
        self.batch = batch
        self.metrics = metrics
        self.backoff = Backoff(backoff_base, backoff_cap)
        self.fetch_timeout = fetch_timeout
        self._slots = asyncio.Semaphore(concurrency)
        self._tasks: set[asyncio.Task[None]] = set()
        self._loop_task: asyncio.Task[None] | None = None
        self._stopping = asyncio.Event()
        self._label = spec.stream
        self._advisories: Any = None
        self._held: dict[int, str] = {}  # stream sequence → the dependency its last retry waited for

    async def start(self) -> None:
        await self._bind()
        try:
            self._advisories = await self.bus.nc.subscribe(
                MAX_DELIVERIES_ADVISORY.format(stream=self.spec.stream, consumer=self.spec.durable),
                queue=f"{self.spec.durable}-exhausted",
                cb=self._on_max_deliveries,
            )
        except (TimeoutError, nats.errors.Error) as exc:
            raise translate_nats_error(exc, f"subscribe to advisories of {self.spec.durable}") from exc
        self._loop_task = asyncio.create_task(self._loop(), name=f"consume:{self.spec.durable}")

    async def _bind(self) -> None:
        await self.bus.ensure_consumer(self.spec)
        try:
            info = await self.bus.js.stream_info(self.spec.stream)
            self._sub = await self.bus.js.pull_subscribe_bind(self.spec.durable, self.spec.stream)
        except (TimeoutError, nats.errors.Error) as exc:
            raise translate_nats_error(exc, f"bind consumer {self.spec.durable}") from exc
        self.stream_epoch = round(info.created.timestamp() * 1_000_000) if info.created else 0

    async def _check_binding(self) -> None:
        """An idle consumer may be a deleted one: create (and bind) it again when it is gone."""
        try:
            await self.bus.js.consumer_info(self.spec.stream, self.spec.durable)
            return
        except nats.js.errors.NotFoundError:
            log.warning(
                "consumer gone (was the stream recreated?); creating it again", consumer=self.spec.durable
            )
        except (TimeoutError, nats.errors.Error) as exc:
            log.warning("consumer check failed", consumer=self.spec.durable, error=str(exc))
            return
        try:
            for stream in standard_streams(self.bus.subjects):
                if stream.name == self.spec.stream:
                    await self.bus.ensure_stream(stream)
            old = self._sub
            await self._bind()
            with contextlib.suppress(nats.errors.Error):
                await old.unsubscribe()
        except ParleyError as exc:
            log.warning("could not create the consumer again", consumer=self.spec.durable, error=str(exc))

    async def _loop(self) -> None:
        checked = time.monotonic()
        while not self._stopping.is_set():
            if self.dependencies.missing():
                # Paused: fetching would only hand out messages that cannot be handled. The held
                # messages probe; a dependency nobody waits on any more is forgotten.
                if not await self.dependencies.wait_all_up(self.fetch_timeout):
                    self.dependencies.unheld(after=self.dependencies.backoff.cap * 2)
                continue
            free = self.concurrency - len(self._tasks)
            if free <= 0:
                await self._slots.acquire()
                self._slots.release()
                continue
            try:
                msgs = await self._sub.fetch(min(self.batch, free), timeout=self.fetch_timeout)
            except (TimeoutError, nats.errors.TimeoutError):
                if time.monotonic() - checked >= self.check_interval:
                    checked = time.monotonic()
                    await self._check_binding()
                continue
            except nats.errors.Error as exc:
                if self._stopping.is_set():
                    return
                log.warning("fetch failed", consumer=self.spec.durable, error=str(exc))
                await asyncio.sleep(0.5)
                if time.monotonic() - checked >= self.check_interval:
                    checked = time.monotonic()
                    await self._check_binding()
                continue
            for msg in msgs:
                await self._slots.acquire()
                task = asyncio.create_task(self._handle(msg))
                self._tasks.add(task)
                task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        self._slots.release()

    async def _handle(self, msg: Msg) -> None:
        meta = msg.metadata
        delivery = Delivery(
            msg=msg,
            subject=msg.subject,
            data=msg.data,
            headers=dict(msg.headers or {}),
            num_delivered=meta.num_delivered,
            stream_sequence=meta.sequence.stream,
            msg_id=(msg.headers or {}).get(MSG_ID, ""),
            stream_epoch=self.stream_epoch,
        )
        started = time.perf_counter()
        outcome = "ack"
        if self.metrics:
            self.metrics.received.labels(self._label).inc()
            self.metrics.inflight.labels(self._label).inc()
        try:
            while True:
                try:
                    await self._with_heartbeat(delivery)
                except Exception as exc:
                    missing = outage_of(exc)
                    if missing is None or self._stopping.is_set():
                        raise
                    await self._hold(delivery, missing, exc)
                    delivery = replace(delivery, retries=delivery.retries + 1)
                    continue
                if delivery.retries:
                    self._back(delivery)
                break
            await msg.ack()
        except asyncio.CancelledError:
            outcome = "cancelled"
            raise
        except Poison as poison:
            outcome = "dead"
            await self.dead_letter(delivery, poison.reason, poison.label)
        except Exception as exc:
            if delivery.retries and outage_of(exc) is None:
                self._back(delivery)
            reason = str(exc) if isinstance(exc, ParleyError) else f"{type(exc).__name__}: {exc}"
            if outage_of(exc) is not None:
                # Stopping while a dependency is away: hand the message back for later (one
                # delivery spent), never to the dead letters.
                outcome = "nak"
                with contextlib.suppress(nats.errors.Error):
                    await msg.nak(delay=self.backoff.delay(delivery.num_delivered))
            elif is_permanent(exc):
                outcome = "dead"
                await self.dead_letter(delivery, f"permanent failure: {reason}", "permanent")
            elif delivery.num_delivered >= self.spec.max_deliver:
                outcome = "dead"
                await self.dead_letter(
                    delivery, f"max_deliver ({self.spec.max_deliver}) reached: {reason}", "max_deliver"
                )
            else:
                outcome = "nak"
                delay = self.backoff.delay(delivery.num_delivered)
                if isinstance(exc, ParleyError):
                    log.warning(
                        "handler failed, will retry",
                        subject=delivery.subject,
                        error=reason,
                        delivery=delivery.num_delivered,
                        delay=delay,
                    )
                else:
                    log.exception(
                        "handler crashed, will retry",
                        subject=delivery.subject,
                        delivery=delivery.num_delivered,
                        delay=delay,
                    )
                with contextlib.suppress(nats.errors.Error):
                    await msg.nak(delay=delay)
        finally:
            if self.metrics:
                self.metrics.inflight.labels(self._label).dec()
                self.metrics.processed.labels(self._label, outcome).observe(time.perf_counter() - started)

    async def _hold(self, delivery: Delivery, missing: str, exc: Exception) -> None:
        """Hold the message (heartbeating, no delivery spent) until it should retry."""
        self.dependencies.down(missing, str(exc)[:300])
        self._held[delivery.stream_sequence] = missing
        held = self.dependencies.metrics.held.labels(self._label) if self.dependencies.metrics else None
        if held is not None:
            held.inc()
        try:
            await self.dependencies.hold(
                missing, delivery.in_progress, max(0.1, min(5.0, self.spec.ack_wait_seconds / 3))
            )
        finally:
            if held is not None:
                held.dec()

    def _back(self, delivery: Delivery) -> None:
        """A held message's retry got past its dependency (done, or failed on its own): it is back."""
        missing = self._held.pop(delivery.stream_sequence, None)
        if missing is not None:
            self.dependencies.up(missing)

    async def _with_heartbeat(self, delivery: Delivery) -> None:
        """Run the handler, telling the server every third of ``ack_wait`` that work goes on,
        so a long turn is not redelivered to another replica while it is alive."""
        task = asyncio.ensure_future(self.handler(delivery))
        interval = max(0.1, self.spec.ack_wait_seconds / 3)
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=interval)
                if done:
                    task.result()
                    return
                await delivery.in_progress()
        finally:
            if not task.done():
                task.cancel()

    async def dead_letter(self, delivery: Delivery, reason: str, label: str) -> None:
        await self._publish_dead(
            delivery.subject,
            delivery.data,
            delivery.stream_sequence,
            delivery.num_delivered,
            delivery.msg_id,
            reason,
            label,
            # Neither nak nor term while it fails: on its last delivery JetStream would never hand
            # the message out again. Hold it (heartbeating) and retry until the dead-letter stream
            # takes it.
            hold=delivery.in_progress,
        )
        with contextlib.suppress(nats.errors.Error):
            await delivery.msg.term()

    async def _publish_dead(
        self,
        subject: str,
        data: bytes,
        sequence: int,
        deliveries: int,
        msg_id: str,
        reason: str,
        label: str,
        hold: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        headers = {
            DEAD_REASON: reason[:1000],
            DEAD_STREAM: self.spec.stream,
            DEAD_SUBJECT: subject,
            DEAD_SEQUENCE: str(sequence),
            DEAD_DELIVERIES: str(deliveries),
            DEAD_CONSUMER: self.spec.durable,
        }
        if msg_id:
            headers[DEAD_MSG_ID] = msg_id
        # One dead letter per message, whichever path (or replica) writes it.
        dead_id = msg_id or f"{self.spec.stream}:{sequence}"
        attempt = 0
        while True:
            try:
                await self.bus.publish(
                    self.bus.subjects.dead(self.spec.stream), data, msg_id=dead_id, headers=headers
                )
                break
            except ParleyError as exc:
                attempt += 1
                log.error(
                    "dead-letter publish failed, retrying",
                    subject=subject,
                    sequence=sequence,
                    attempt=attempt,
                    error=str(exc),
                )
                if hold is not None:
                    await hold()
                await asyncio.sleep(self.backoff.delay(attempt))
        log.warning("message dead-lettered", subject=subject, reason=reason[:200])
        if self.metrics:
            self.metrics.dead.labels(self._label, label).inc()

    async def _on_max_deliveries(self, msg: Msg) -> None:
        """The last allowed delivery of a message went unanswered (its handler's process died)."""
        try:
            advisory = json.loads(msg.data)
            sequence, deliveries = int(advisory["stream_seq"]), int(advisory.get("deliveries", 0))
        except (ValueError, KeyError, TypeError):
            log.warning("unreadable max-deliveries advisory", consumer=self.spec.durable)
            return
        try:
            stored = await self.bus.js.get_msg(self.spec.stream, sequence)
        except (TimeoutError, nats.errors.Error) as exc:
            # Already removed from the stream (or the stream is unreachable): nothing to keep.
            log.warning(
                "message of a max-deliveries advisory not readable",
                consumer=self.spec.durable,
                sequence=sequence,
                error=str(exc),
            )
            return
        subject, data = stored.subject or "", stored.data or b""
        await self._publish_dead(
            subject,
            data,
            sequence,
            deliveries,
            (stored.headers or {}).get(MSG_ID, ""),
            f"max_deliver ({self.spec.max_deliver}) reached: no delivery was acknowledged "
            "(the handling process died or stalled)",
            "exhausted",
        )
        if self.on_exhausted is not None:
            try:
                await self.on_exhausted(subject, data, sequence)
            except Exception as exc:
                log.error(
                    "exhausted-message hook failed",
                    consumer=self.spec.durable,
                    error=f"{type(exc).__name__}: {exc}",
                )

    def stop_taking_work(self) -> None:
        """Fetch no more: the fetch under way (at most ``fetch_timeout``) is the last one."""
        self._stopping.set()

    async def stop(self, timeout: float = 10.0) -> None:
        """Stop fetching, let in-flight handlers finish for up to ``timeout``, then cancel them."""
        self.stop_taking_work()
        if self._loop_task:
            with contextlib.suppress(asyncio.CancelledError, asyncio.TimeoutError):
                await asyncio.wait_for(asyncio.shield(self._loop_task), self.fetch_timeout + 1)
            if not self._loop_task.done():
                self._loop_task.cancel()
        if self._tasks:
            _, pending = await asyncio.wait(set(self._tasks), timeout=timeout)
            for task in pending:
                task.cancel()
            if pending:
                await asyncio.wait(pending, timeout=1)
        with contextlib.suppress(nats.errors.Error):
            await self._sub.unsubscribe()
        if self._advisories is not None:
            with contextlib.suppress(nats.errors.Error):
                await self._advisories.unsubscribe()
