"""Decision events: published after the reply, in batches, with a record of what went out.

A decision is durable before its event is published; ``announced`` in the
row records the last status whose event went out. The announcer publishes
what the API hands it and marks a whole batch with one statement; the sweeper
publishes again what was never marked (the replica died in between).
JetStream drops a repeat within its duplicate window (Nats-Msg-Id
``authz:<agent>:<tool_call_id>:<status>``).
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
# How long the announcer lets decisions gather before publishing a batch: one
# marking statement then covers every decision of a busy moment.
LINGER_SECONDS = 0.005


class Announcer:
    def __init__(self, bus: Bus, store: AuthzStore) -> None:
        self.bus = bus
        self.store = store
        self._queue: list[tuple[ToolCall, authz_pb2.ToolCall | None]] = []
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._task: asyncio.Task[None] | None = None

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
            await asyncio.sleep(LINGER_SECONDS)
            self._wake.clear()
            while self._queue:
                batch, self._queue = self._queue[:BATCH], self._queue[BATCH:]
                await self._publish(batch)
            self._idle.set()

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
        return await self._publish([(call, None) for call in calls])

    async def _publish(self, batch: list[tuple[ToolCall, authz_pb2.ToolCall | None]]) -> int:
        outcomes = await asyncio.gather(*(self._send(call, message) for call, message in batch))
        sent = [call for (call, _), ok in zip(batch, outcomes, strict=True) if ok]
        if sent:
            try:
                await self.store.mark_announced(sent)
            except ParleyError as exc:
                # Published, not recorded: the sweeper publishes them again; JetStream drops the repeat.
                log.warning("events not recorded as published", code=exc.code, count=len(sent))
        return len(sent)

    async def drain(self, timeout: float) -> None:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                await self._idle.wait()

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
