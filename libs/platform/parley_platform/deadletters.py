"""Dead letters made operable: list, show, replay and purge the PARLEY_DEAD stream.

A dead letter is the original message's bytes on ``<ns>.dead.<stream>`` with headers saying
where it came from and why (``parley_platform.consumer``). Replay publishes those bytes to the
original subject again under the original dedup identity (its Nats-Msg-Id; inside JetStream's
duplicate window, where that id is still remembered, under ``<id>:replay:<dead sequence>``), so a
message that was in fact answered is deduplicated by JetStream or by its consumer's own store,
and replaying a dead letter twice publishes one copy. The dead letter is removed only once the
copy is handled: the consumer that gave up on it (Parley-Dead-Consumer) has acknowledged (or
terminated) everything up to the copy's sequence.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime

import nats.errors
import nats.js.errors
from google.protobuf.timestamp_pb2 import Timestamp
from nats.js.api import ConsumerConfig, DeliverPolicy

from parley.v1 import dead_pb2

from . import codes
from .bus import MSG_ID, Bus, translate_nats_error
from .consumer import (
    DEAD_CONSUMER,
    DEAD_DELIVERIES,
    DEAD_MSG_ID,
    DEAD_REASON,
    DEAD_SEQUENCE,
    DEAD_STREAM,
    DEAD_SUBJECT,
)
from .logging import get_logger

log = get_logger(__name__)

DEFAULT_LIMIT, MAX_LIMIT = 50, 100
DEFAULT_WAIT, MAX_WAIT = 30.0, 300.0
MAX_REPLAY = 1000
REPLAY_OF = "Parley-Replay-Of"  # header of a replayed copy: the dead letter's sequence

# An agent reference (a name the caller used) → its id; None when no agent has that name or id.
ResolveAgent = Callable[[str], Awaitable[str | None]]


@dataclass(frozen=True)
class _Filter:
    stream: str
    reason: str
    agent_id: str
    since: datetime | None
    until: datetime | None
    sequences: frozenset[int]

    def empty(self) -> bool:
        return not (self.stream or self.reason or self.agent_id or self.since or self.until or self.sequences)

    def keeps(self, letter: dead_pb2.DeadLetter) -> bool:
        if self.sequences and letter.sequence not in self.sequences:
            return False
        if self.stream and letter.stream != self.stream:
            return False
        if self.reason and self.reason not in letter.reason.lower():
            return False
        if self.agent_id and letter.agent_id != self.agent_id:
            return False
        dead_at = letter.dead_at.ToDatetime(tzinfo=UTC)
        if self.since and dead_at < self.since:
            return False
        return not (self.until and dead_at > self.until)


def _time(stamp: Timestamp, field: str) -> datetime | None:
    if not stamp.seconds and not stamp.nanos:
        return None
    try:
        return stamp.ToDatetime(tzinfo=UTC)
    except (ValueError, OverflowError) as exc:
        raise codes.INVALID_ARGUMENT(f"filter.{field} is not a valid time") from exc


def agent_of(subject: str) -> str:
    """``<ns>.<kind>.<agent>.…`` → the agent token (every Parley stream's subjects name it there)."""
    tokens = subject.split(".")
    return tokens[2] if len(tokens) > 2 else ""


class DeadLetters:
    """The operator's ``DeadLetters`` service (``proto/parley/v1/dead.proto``)."""

    def __init__(self, bus: Bus, resolve_agent: ResolveAgent) -> None:
        self.bus = bus
        self.resolve_agent = resolve_agent
        self.stream = bus.subjects.stream("DEAD")

    async def _filter(self, given: dead_pb2.DeadLetterFilter) -> _Filter:
        stream = given.stream.strip()
        prefix = f"{self.bus.subjects.ns.upper()}_"
        if stream and not stream.startswith(prefix):
            stream = prefix + stream.upper().removeprefix("PARLEY_")
        agent = given.agent.strip()
        agent_id = (await self.resolve_agent(agent) or agent) if agent else ""
        since, until = _time(given.since, "since"), _time(given.until, "until")
        if since and until and since > until:
            raise codes.INVALID_ARGUMENT("filter.since is after filter.until")
        return _Filter(
            stream, given.reason.strip().lower(), agent_id, since, until, frozenset(given.sequences)
        )

    @staticmethod
    def _letter(
        headers: dict[str, str], payload: bytes, sequence: int, dead_at: datetime | None, data: bool
    ) -> dead_pb2.DeadLetter:
        subject = headers.get(DEAD_SUBJECT, "")
        letter = dead_pb2.DeadLetter(
            sequence=sequence,
            stream=headers.get(DEAD_STREAM, ""),
            subject=subject,
            original_sequence=_int(headers.get(DEAD_SEQUENCE)),
            consumer=headers.get(DEAD_CONSUMER, ""),
            msg_id=headers.get(DEAD_MSG_ID, "") or headers.get(MSG_ID, ""),
            reason=headers.get(DEAD_REASON, ""),
            deliveries=_int(headers.get(DEAD_DELIVERIES)),
            agent_id=agent_of(subject),
            size=len(payload),
            data=payload if data else b"",
        )
        if dead_at is not None:
            letter.dead_at.FromDatetime(dead_at)
        return letter

    async def _scan(self, chosen: _Filter, after: int, limit: int) -> tuple[list[dead_pb2.DeadLetter], int]:
        """Dead letters after sequence ``after`` that the filter keeps, at most ``limit``; and the
        sequence to continue from (0 when the stream has no more)."""
        try:
            info = await self.bus.js.stream_info(self.stream)
        except (TimeoutError, nats.errors.Error) as exc:
            raise translate_nats_error(exc, "read the dead-letter stream") from exc
        last = info.state.last_seq
        start = max(after + 1, info.state.first_seq)
        if info.state.messages == 0 or start > last:
            return [], 0
        found: list[dead_pb2.DeadLetter] = []
        sub = await self.bus.js.subscribe(
            self.bus.subjects.dead(">"),
            ordered_consumer=True,
            config=ConsumerConfig(deliver_policy=DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=start),
        )
        position = start - 1
        try:
            while position < last and len(found) < limit:
                try:
                    msg = await sub.next_msg(timeout=5)
                except (TimeoutError, nats.errors.TimeoutError):
                    break  # the rest was removed meanwhile
                position = msg.metadata.sequence.stream
                letter = self._letter(
                    dict(msg.headers or {}), msg.data or b"", position, msg.metadata.timestamp, data=False
                )
                if chosen.keeps(letter):
                    found.append(letter)
        finally:
            await sub.unsubscribe()
        return found, (position if position < last and len(found) >= limit else 0)

    async def _get(self, sequence: int) -> dead_pb2.DeadLetter:
        if sequence <= 0:
            raise codes.INVALID_ARGUMENT("sequence must be a dead letter's sequence (1 or more)")
        try:
            raw = await self.bus.js.get_msg(self.stream, sequence)
        except nats.js.errors.NotFoundError as exc:
            raise codes.DEAD_LETTER_NOT_FOUND(f"no dead letter {sequence}") from exc
        except (TimeoutError, nats.errors.Error) as exc:
            raise translate_nats_error(exc, f"read dead letter {sequence}") from exc
        dead_at = raw.time
        return self._letter(dict(raw.headers or {}), raw.data or b"", sequence, dead_at, data=True)

    # -- the service -------------------------------------------------------------------------

    async def ListDeadLetters(
        self, request: dead_pb2.ListDeadLettersRequest
    ) -> dead_pb2.ListDeadLettersResponse:
        limit = request.limit or DEFAULT_LIMIT
        if not 1 <= limit <= MAX_LIMIT:
            raise codes.INVALID_PAGE(f"limit must be an integer from 1 to {MAX_LIMIT}, got {request.limit}")
        found, next_after = await self._scan(await self._filter(request.filter), request.after, limit)
        return dead_pb2.ListDeadLettersResponse(dead_letters=found, next_after=next_after)

    async def GetDeadLetter(self, request: dead_pb2.GetDeadLetterRequest) -> dead_pb2.DeadLetter:
        return await self._get(request.sequence)

    async def PurgeDeadLetters(
        self, request: dead_pb2.PurgeDeadLettersRequest
    ) -> dead_pb2.PurgeDeadLettersResponse:
        chosen = await self._filter(request.filter)
        if chosen.empty() and not request.all:
            raise codes.INVALID_ARGUMENT(
                "name dead letters (a filter or sequences), or set all to purge every one"
            )
        purged = 0
        after = 0
        while True:
            found, after = await self._scan(chosen, after, MAX_LIMIT)
            for letter in found:
                purged += await self._delete(letter.sequence)
            if not after:
                break
        log.warning("dead letters purged", purged=purged)
        return dead_pb2.PurgeDeadLettersResponse(purged=purged)

    async def _delete(self, sequence: int) -> int:
        try:
            await self.bus.js.delete_msg(self.stream, sequence)
        except nats.js.errors.NotFoundError:
            return 0
        except (TimeoutError, nats.errors.Error) as exc:
            if "no message found" in str(exc).lower():
                return 0
            raise translate_nats_error(exc, f"remove dead letter {sequence}") from exc
        return 1

    async def ReplayDeadLetters(
        self, request: dead_pb2.ReplayDeadLettersRequest
    ) -> dead_pb2.ReplayDeadLettersResponse:
        wait = request.wait_seconds or DEFAULT_WAIT
        if not 0 < wait <= MAX_WAIT:
            raise codes.INVALID_ARGUMENT(f"wait_seconds must be more than 0 and at most {MAX_WAIT:.0f}")
        limit = request.limit or MAX_LIMIT
        if not 1 <= limit <= MAX_REPLAY:
            raise codes.INVALID_ARGUMENT(f"limit must be from 1 to {MAX_REPLAY}")
        chosen = await self._filter(request.filter)
        if chosen.empty():
            raise codes.INVALID_ARGUMENT("name the dead letters to replay (a filter or sequences)")
        letters: list[dead_pb2.DeadLetter] = []
        after = 0
        while len(letters) < limit:
            found, after = await self._scan(chosen, after, min(MAX_LIMIT, limit - len(letters)))
            letters += found
            if not after:
                break
        if chosen.sequences and not letters:
            raise codes.DEAD_LETTER_NOT_FOUND(
                f"no dead letter {', '.join(map(str, sorted(chosen.sequences)))}"
            )
        replayed = [await self._publish(await self._get(letter.sequence)) for letter in letters]
        deadline = time.monotonic() + wait
        results = []
        for letter, (sequence, msg_id, fresh) in zip(letters, replayed, strict=True):
            handled = await self._handled(letter, sequence, deadline)
            if handled:
                await self._delete(letter.sequence)
            outcome = "handled" if handled else ("pending" if fresh else "duplicate_pending")
            log.info("dead letter replayed", sequence=letter.sequence, outcome=outcome, copy=sequence)
            results.append(
                dead_pb2.Replayed(
                    sequence=letter.sequence, outcome=outcome, replay_sequence=sequence, msg_id=msg_id
                )
            )
        return dead_pb2.ReplayDeadLettersResponse(replayed=results)

    async def _publish(self, letter: dead_pb2.DeadLetter) -> tuple[int, str, bool]:
        """Publish the copy; (its sequence in the original stream, its msg id, whether it is new)."""
        if not letter.subject:
            raise codes.INVALID_ARGUMENT(f"dead letter {letter.sequence} does not say its original subject")
        original = letter.msg_id or f"{letter.stream}:{letter.original_sequence}"
        sequence, fresh = await self._publish_as(letter, original)
        if fresh:
            return sequence, original, True
        # Still inside the duplicate window, the stream remembers the original id: that copy is the
        # very message that was dead-lettered. Publish under the replay's own id instead (a second
        # replay of this dead letter then lands on the first replay's copy).
        replay_id = f"{original}:replay:{letter.sequence}"
        sequence, fresh = await self._publish_as(letter, replay_id)
        return sequence, replay_id, fresh

    async def _publish_as(self, letter: dead_pb2.DeadLetter, msg_id: str) -> tuple[int, bool]:
        headers = {MSG_ID: msg_id, REPLAY_OF: str(letter.sequence)}
        try:
            ack = await self.bus.js.publish(letter.subject, letter.data, headers=headers, timeout=5)
        except (TimeoutError, nats.errors.Error) as exc:
            raise translate_nats_error(exc, f"replay dead letter {letter.sequence}") from exc
        return ack.seq, not ack.duplicate

    async def _handled(self, letter: dead_pb2.DeadLetter, sequence: int, deadline: float) -> bool:
        consumers = [letter.consumer] if letter.consumer else await self._consumers_of(letter)
        if not consumers:
            return False
        while True:
            floors = []
            for name in consumers:
                try:
                    info = await self.bus.js.consumer_info(letter.stream, name)
                except (TimeoutError, nats.errors.Error):
                    floors.append(0)
                    continue
                floors.append(info.ack_floor.stream_seq if info.ack_floor else 0)
            if min(floors) >= sequence:
                return True
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.2)

    async def _consumers_of(self, letter: dead_pb2.DeadLetter) -> list[str]:
        """An older dead letter names no consumer: every durable of its stream that takes its subject."""
        try:
            infos = await self.bus.js.consumers_info(letter.stream)
        except (TimeoutError, nats.errors.Error):
            return []
        return [
            info.name
            for info in infos
            if info.config.durable_name and _matches(info.config.filter_subject or ">", letter.subject)
        ]


def _matches(pattern: str, subject: str) -> bool:
    p, s = pattern.split("."), subject.split(".")
    for i, token in enumerate(p):
        if token == ">":
            return len(s) > i
        if i >= len(s) or (token != "*" and token != s[i]):
            return False
    return len(p) == len(s)


def _int(value: str | None) -> int:
    try:
        return int(value or 0)
    except ValueError:
        return 0
