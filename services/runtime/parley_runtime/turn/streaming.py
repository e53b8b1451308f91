"""A turn's streamed reply and its abort.

``ReplyStream`` publishes the reply's text as ``StreamChunk`` messages on core NATS
``<ns>.stream.<agent_id>.<source>`` (sequence 1, 2, ...; the last one ``final`` with the turn's
outcome: completed, revised, ignored, superseded, cancelled or failed). The complete reply still
goes durably to OUTBOUND under the same response id.

``Abort`` is how a running turn is stopped: a cancel (a connector, an operator) or a newer message
in its room. ``RunningTurns`` holds this replica's running turns; every replica hears every cancel
and supersede notice, and the one holding the turn acts.
"""

from __future__ import annotations

import asyncio
import inspect
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import cached_property
from typing import TypeVar

from prometheus_client import Histogram

from parley.v1 import runtime_pb2
from parley_platform.bus import Bus
from parley_platform.errors import ParleyError
from parley_platform.logging import get_logger

from .. import ids

log = get_logger(__name__)

T = TypeVar("T")

COMPLETED, REVISED, IGNORED, FAILED = "completed", "revised", "ignored", "failed"
SUPERSEDED, CANCELLED = "superseded", "cancelled"
_SEALED = "delivering"
FINAL_OUTCOMES = {"replied": COMPLETED, "ignored": IGNORED, SUPERSEDED: SUPERSEDED, CANCELLED: CANCELLED}


class Aborted(Exception):
    def __init__(self, outcome: str, reason: str) -> None:
        super().__init__(f"turn {outcome}: {reason}")
        self.outcome = outcome
        self.reason = reason


class Abort:
    """Set once, by whoever stops the turn; what the turn awaits under ``guard`` is cancelled."""

    def __init__(self) -> None:
        self.outcome: str | None = None
        self.reason = ""
        self._guarded: asyncio.Task[object] | None = None  # the task awaiting under ``guard``
        self._stopped_it = False

    def request(self, outcome: str, reason: str) -> bool:
        if self.outcome is not None:
            return False
        self.outcome, self.reason = outcome, reason
        if self._guarded is not None:
            self._stopped_it = True
            self._guarded.cancel()
        return True

    def check(self) -> None:
        if self.outcome is not None and not self.sealed:
            raise Aborted(self.outcome, self.reason)

    @property
    def sealed(self) -> bool:
        return self.outcome == _SEALED

    def seal(self) -> Aborted | None:
        """The turn is delivering its replies: too late to stop it. Returns the abort that came
        first, if one did."""
        if self.outcome is None:
            self.outcome = _SEALED
            return None
        return None if self.sealed else Aborted(self.outcome, self.reason)

    async def guard(self, work: Awaitable[T]) -> T:
        """``work``'s result, unless the turn is aborted first: then ``work`` is cancelled where it
        waits (a model stream closes, and the gateway closes its provider's) and ``Aborted`` is
        raised. ``work`` runs in the caller's own task, which an abort cancels: no task of its own
        and no race between two (a tenth of a millisecond of a turn's path)."""
        try:
            self.check()
        except Aborted:
            if inspect.iscoroutine(work):
                work.close()  # never started
            raise
        task = asyncio.current_task()
        assert task is not None
        self._guarded, self._stopped_it = task, False
        try:
            result = await work
        except asyncio.CancelledError:
            # This abort's cancel, and no other (a shutdown's) pending: the turn is aborted.
            if self._stopped_it and task.uncancel() == 0:
                raise Aborted(self.outcome or CANCELLED, self.reason) from None
            raise
        finally:
            self._guarded = None
        if self._stopped_it:  # the work swallowed the abort's cancel: spent, and the turn aborted
            task.uncancel()
            self.check()
        return result


class ChunkPublisher:
    def __init__(self, bus: Bus) -> None:
        self.bus = bus

    async def publish(self, chunk: runtime_pb2.StreamChunk) -> None:
        """Best effort: a stream chunk lost to a NATS hiccup never fails the turn."""
        try:
            await self.bus.publish_core(
                self.bus.subjects.chunks(chunk.agent_id, chunk.source), chunk.SerializeToString()
            )
        except ParleyError as exc:
            log.warning("stream chunk not published", code=exc.code, turn_id=chunk.turn_id)


@dataclass
class ReplyStream:
    """The chunks of one turn's first reply."""

    publisher: ChunkPublisher
    first_chunk: Histogram
    agent_id: uuid.UUID
    turn_id: uuid.UUID
    source: str
    channel_id: str
    in_reply_to: str
    started: float = field(default_factory=time.perf_counter)
    opened: bool = False  # the reply is being generated: its end will be announced
    sequence: int = 0
    text: str = ""
    final: str | None = None
    pending: str = ""  # text sent but not yet published
    flushing: asyncio.Task[None] | None = None

    @cached_property  # a uuid5: found once, not for every chunk
    def response_id(self) -> uuid.UUID:
        return ids.response_id(self.turn_id, 0)

    async def send(self, delta: str) -> None:
        if not delta or self.final is not None:
            return
        if not self.text:
            self.first_chunk.observe(time.perf_counter() - self.started)
        self.text += delta
        self.pending += delta
        if self.flushing is None:
            self.flushing = asyncio.ensure_future(self._flush())

    async def _flush(self) -> None:
        """One chunk for the text sent until the event loop's next turn: a model's pieces that
        arrive together (one message of a streamed call) are one chunk, not one each."""
        await asyncio.sleep(0)
        delta, self.pending, self.flushing = self.pending, "", None
        if delta and self.final is None:
            await self._publish(delta, final=False, outcome="")

    async def close(self, outcome: str, delta: str = "") -> None:
        """The final chunk, once, with any text not yet published; only for a turn that got as far
        as generating its reply, or was stopped."""
        if self.final is not None or not (self.opened or outcome in (SUPERSEDED, CANCELLED)):
            return
        if self.flushing is not None:
            self.flushing.cancel()
            self.flushing = None
        self.final = outcome
        self.text += delta
        delta, self.pending = self.pending + delta, ""
        await self._publish(delta, final=True, outcome=outcome)

    async def _publish(self, delta: str, *, final: bool, outcome: str) -> None:
        self.sequence += 1
        await self.publisher.publish(
            runtime_pb2.StreamChunk(
                agent_id=str(self.agent_id),
                source=self.source,
                turn_id=str(self.turn_id),
                response_id=str(self.response_id),
                channel_id=self.channel_id,
                in_reply_to=self.in_reply_to,
                sequence=self.sequence,
                delta=delta,
                final=final,
                outcome=outcome,
            )
        )


@dataclass
class Running:
    agent_id: uuid.UUID
    turn_id: uuid.UUID
    room_id: uuid.UUID
    source: str
    lease_token: int
    keeps_replies: bool  # BASIC_CAPABILITIES_KEEP_RESP: a newer message does not discard them
    abort: Abort


class RunningTurns:
    """This replica's running turns, to stop one on a cancel or a newer message in its room."""

    def __init__(self) -> None:
        self._turns: dict[tuple[uuid.UUID, uuid.UUID], Running] = {}
        self.on_abort: Callable[[Running, str], None] = lambda running, outcome: None

    @contextmanager
    def track(self, running: Running) -> Iterator[None]:
        key = (running.agent_id, running.turn_id)
        self._turns[key] = running
        try:
            yield
        finally:
            if self._turns.get(key) is running:
                del self._turns[key]

    def get(self, agent_id: uuid.UUID, turn_id: uuid.UUID) -> Running | None:
        return self._turns.get((agent_id, turn_id))

    def cancel(self, agent_id: uuid.UUID, turn_id: uuid.UUID, *, source: str | None, reason: str) -> bool:
        """Cancel the turn if it runs here (and, when ``source`` is given, belongs to it)."""
        running = self._turns.get((agent_id, turn_id))
        if running is None or (source is not None and running.source != source):
            return False
        return self._stop(running, CANCELLED, reason or "cancelled")

    def supersede(self, agent_id: uuid.UUID, room_id: uuid.UUID, lease_token: int) -> int:
        """A newer message took the room (its lease is now ``lease_token``): its older turns stop."""
        stopped = 0
        for running in list(self._turns.values()):
            if (
                running.agent_id == agent_id
                and running.room_id == room_id
                and running.lease_token < lease_token
                and not running.keeps_replies
            ):
                stopped += self._stop(running, SUPERSEDED, "a newer message arrived in the room")
        return stopped

    def _stop(self, running: Running, outcome: str, reason: str) -> bool:
        if not running.abort.request(outcome, reason):
            return False
        log.info(
            "turn stopped", agent_id=str(running.agent_id), turn_id=str(running.turn_id), outcome=outcome
        )
        self.on_abort(running, outcome)
        return True
