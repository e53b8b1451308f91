"""Decision events: published right after the reply, with a record of what went out.

A decision is durable before its event is published; ``announced`` in the
row records the last status whose event went out. The announcer publishes
what the API hands it as soon as it can (what arrives while a publish is in
flight goes out together next), and records what went out a little later,
for every decision of that moment in one statement: recording each decision
apart cost as much as the decision itself (docs/performance.md). The sweeper
publishes again what was not recorded within its grace period (the replica
died in between); JetStream drops a repeat within its duplicate window
(Nats-Msg-Id ``authz:<agent>:<tool_call_id>:<status>``).
"""

from __future__ import annotations

import asyncio
import contextlib

from parley.v1 import authz_pb2
from parley_platform.bus import Bus
from parley_platform.errors import ParleyError
from parley_platform.logging import get_logger

from .model import ToolCall
from .store import AuthzStore

log = get_logger(__name__)

EVENT_TYPES = {"claimed": "TOOL_CALL_CLAIMED", "settled": "TOOL_CALL_SETTLED"}
BATCH = 256
# How long published events wait to be recorded, so that one statement records every event of a
# busy moment. Far below the sweeper's grace period (5 s by default): a recorded event is never
# published twice, and one not yet recorded when its replica dies goes out again, deduplicated.
RECORD_DELAY_SECONDS = 0.2


class Announcer:
    def __init__(self, bus: Bus, store: AuthzStore) -> None:
        self.bus = bus
        self.store = store
        self._queue: list[tuple[ToolCall, authz_pb2.ToolCall | None]] = []
        self._published: list[ToolCall] = []  # sent, not yet recorded
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._task: asyncio.Task[None] | None = None
        self._recorder: asyncio.Task[None] | None = None

    def push(self, call: ToolCall, message: authz_pb2.ToolCall | None = None) -> None:
        """Queue the call's event; ``message`` is its message when the caller has built it already."""
        if call.status not in EVENT_TYPES:
            return
        self._queue.append((call, message))
        self._idle.clear()
        self._wake.set()
        if self._task is None:
            self._task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._queue:
                batch, self._queue = self._queue[:BATCH], self._queue[BATCH:]
                sent = await self._send_all(batch)
                if sent:
                    self._published += sent
                    if self._recorder is None or self._recorder.done():
                        self._recorder = asyncio.create_task(self._record_soon())
            self._idle.set()

    async def _record_soon(self) -> None:
        await asyncio.sleep(RECORD_DELAY_SECONDS)
        await self._record_published()

    async def _record_published(self) -> None:
        sent, self._published = self._published, []
        await self._record(sent)

    async def _send(self, call: ToolCall, message: authz_pb2.ToolCall | None) -> bool:
        event_type = EVENT_TYPES[call.status]
        if message is None:
            message = call.to_proto(with_claim=call.status == "claimed")
        event = authz_pb2.ToolCallEvent(type=event_type, tool_call=message)
        agent_id = str(call.agent_id)
        try:
            await self.bus.publish(
                self.bus.subjects.events(agent_id, event_type),
                event.SerializeToString(),
                msg_id=f"authz:{agent_id}:{call.id}:{call.status}",
            )
        except ParleyError as exc:
            log.warning(
                "event not published; the sweeper retries",
                agent_id=agent_id,
                tool_call_id=call.id,
                code=exc.code,
            )
            return False
        return True

    async def publish(self, calls: list[ToolCall]) -> int:
        """Publish the calls' events together, then record the ones that went out; returns how many."""
        sent = await self._send_all([(call, None) for call in calls])
        await self._record(sent)
        return len(sent)

    async def _send_all(self, batch: list[tuple[ToolCall, authz_pb2.ToolCall | None]]) -> list[ToolCall]:
        outcomes = await asyncio.gather(*(self._send(call, message) for call, message in batch))
        return [call for (call, _), ok in zip(batch, outcomes, strict=True) if ok]

    async def _record(self, sent: list[ToolCall]) -> None:
        if not sent:
            return
        try:
            await self.store.mark_announced(sent)
        except ParleyError as exc:
            # Published, not recorded: the sweeper publishes them again; JetStream drops the repeat.
            log.warning("events not recorded as published", code=exc.code, count=len(sent))

    async def drain(self, timeout: float) -> None:
        """Wait until every event handed over is published and recorded."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                await self._idle.wait()
                await self._record_published()
                if self._recorder is not None:  # it may be recording an earlier moment's events
                    await asyncio.gather(self._recorder, return_exceptions=True)

    async def close(self) -> None:
        for task in (self._task, self._recorder):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        self._task = self._recorder = None
