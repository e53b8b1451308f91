"""Stopping running turns, whichever replica runs them.

Every replica subscribes (not in a queue group) to:

- ``<ns>.cancel.<agent_id>.<source>``: connectors' cancels (CancelTurnRequest). The subject's
  agent and source win over the request's fields: a connector, allowed to publish only its own
  subject, can only cancel its own source's turns;
- ``<ns>.runtime.turns.cancel``: CancelTurn calls (gRPC or NATS) that the replica serving the
  call does not hold, passed on to every replica;
- ``<ns>.runtime.rooms.taken``: a newer message took a room (``agent room lease``), sent by
  the replica that ingested it: older turns of that room are superseded.

The replica holding the turn stops it and, when the message was a request, answers; the others
stay silent. A CancelTurn whose turn no replica holds gets ``cancelled=false`` after
``CANCEL_WAIT_SECONDS``.
"""

from __future__ import annotations

import contextlib
import hashlib
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import nats.errors
from google.protobuf.message import DecodeError

from parley.v1 import runtime_pb2
from parley_platform.bus import Bus
from parley_platform.consumer import DEAD_REASON, DEAD_STREAM, DEAD_SUBJECT
from parley_platform.convert import uuid_or_none
from parley_platform.errors import ParleyError
from parley_platform.logging import get_logger

from .. import errors, ids
from ..agents.directory import AgentInfo
from .streaming import RunningTurns

log = get_logger(__name__)

CANCEL_WAIT_SECONDS = 1.0


class TurnControl:
    def __init__(self, bus: Bus, running: RunningTurns) -> None:
        self.bus = bus
        self.running = running
        self.broadcast = bus.subjects.rpc("runtime", "turns.cancel")
        self.rooms = bus.subjects.rpc("runtime", "rooms.taken")

    async def start(self) -> None:
        await self.bus.subscribe(f"{self.bus.subjects.ns}.cancel.*.*", self._on_connector_cancel)
        await self.bus.subscribe(self.broadcast, self._on_broadcast)
        await self.bus.subscribe(self.rooms, self._on_room_taken)

    # -- CancelTurn ----------------------------------------------------------------------------

    async def cancel_turn(self, request: runtime_pb2.CancelTurnRequest) -> runtime_pb2.CancelTurnResponse:
        """CancelTurn (gRPC and NATS): here if the turn runs here, else on the replica that runs it."""
        agent_id, turn_id = self._target(request, request.source or None)
        if self.running.cancel(agent_id, turn_id, source=None, reason=request.reason or "cancelled"):
            return runtime_pb2.CancelTurnResponse(cancelled=True, turn_id=str(turn_id))
        forwarded = runtime_pb2.CancelTurnRequest(
            agent_id=str(agent_id), turn_id=str(turn_id), reason=request.reason
        )
        try:
            reply = await self.bus.nc.request(
                self.broadcast, forwarded.SerializeToString(), timeout=CANCEL_WAIT_SECONDS
            )
        except (TimeoutError, nats.errors.Error):
            return runtime_pb2.CancelTurnResponse(cancelled=False, turn_id=str(turn_id))
        try:
            return runtime_pb2.CancelTurnResponse.FromString(reply.data)
        except DecodeError:
            return runtime_pb2.CancelTurnResponse(cancelled=False, turn_id=str(turn_id))

    def _target(
        self, request: runtime_pb2.CancelTurnRequest, source: str | None
    ) -> tuple[uuid.UUID, uuid.UUID]:
        agent_id = uuid_or_none(request.agent_id)
        if agent_id is None:
            raise errors.INVALID_CANCEL("agent_id must be an agent's UUID")
        if request.turn_id:
            turn_id = uuid_or_none(request.turn_id)
            if turn_id is None:
                raise errors.INVALID_CANCEL("turn_id must be a UUID")
            return agent_id, turn_id
        if not request.message_id or not source:
            raise errors.INVALID_CANCEL("name the turn: turn_id, or message_id with its source")
        return agent_id, ids.message_id(agent_id, source, request.message_id)

    # -- what every replica hears --------------------------------------------------------------

    async def _on_broadcast(self, msg: Any) -> None:
        try:
            request = runtime_pb2.CancelTurnRequest.FromString(msg.data)
            agent_id, turn_id = self._target(request, None)
        except (DecodeError, ParleyError):
            return
        if self.running.cancel(agent_id, turn_id, source=None, reason=request.reason or "cancelled"):
            await self._answer(msg, turn_id)

    async def _on_connector_cancel(self, msg: Any) -> None:
        _, _, agent, source = msg.subject.split(".", 3)
        try:
            request = runtime_pb2.CancelTurnRequest.FromString(msg.data)
            request.agent_id, request.source = agent, source  # the subject wins
            agent_id, turn_id = self._target(request, source)
        except DecodeError:
            await self._dead(msg, "not a CancelTurnRequest")
            return
        except ParleyError as exc:
            await self._dead(msg, exc.message)
            return
        reason = request.reason or f"cancelled by the {source} connector"
        if self.running.cancel(agent_id, turn_id, source=source, reason=reason):
            await self._answer(msg, turn_id)

    async def _dead(self, msg: Any, reason: str) -> None:
        """A malformed cancel goes to the dead-letter stream with its reason; nothing else happens.
        Every replica hears it: the message id keeps one copy."""
        log.info("connector cancel refused", subject=msg.subject, reason=reason)
        headers = {DEAD_REASON: reason[:1000], DEAD_SUBJECT: msg.subject, DEAD_STREAM: ""}
        copy = hashlib.sha256(msg.subject.encode() + b"\0" + msg.data).hexdigest()[:32]
        with contextlib.suppress(ParleyError):
            await self.bus.publish(
                self.bus.subjects.dead("CANCEL"), msg.data[:65536], headers=headers, msg_id=f"cancel:{copy}"
            )

    async def _on_room_taken(self, msg: Any) -> None:
        try:
            agent, room, token = msg.data.decode().split()
            self.running.supersede(uuid.UUID(agent), uuid.UUID(room), int(token))
        except (ValueError, UnicodeDecodeError):
            return

    async def room_taken(self, agent_id: uuid.UUID, room_id: uuid.UUID, lease_token: int) -> None:
        """Tell every replica (this one too) that a newer message holds the room."""
        with contextlib.suppress(ParleyError):
            await self.bus.publish_core(self.rooms, f"{agent_id} {room_id} {lease_token}".encode())

    async def _answer(self, msg: Any, turn_id: uuid.UUID) -> None:
        if not msg.reply:
            return
        answer = runtime_pb2.CancelTurnResponse(cancelled=True, turn_id=str(turn_id))
        with contextlib.suppress(nats.errors.Error):
            await self.bus.nc.publish(msg.reply, answer.SerializeToString())


class CancelTurnApi:
    """``Runtime.CancelTurn``, beside ``RuntimeApi``'s methods; the agent named by id or name."""

    def __init__(self, control: TurnControl, find_agent: Callable[[str], Awaitable[AgentInfo]]) -> None:
        self.control = control
        self.find_agent = find_agent

    async def CancelTurn(self, request: runtime_pb2.CancelTurnRequest) -> runtime_pb2.CancelTurnResponse:
        if uuid_or_none(request.agent_id) is None and request.agent_id:
            request.agent_id = str((await self.find_agent(request.agent_id)).id)
        return await self.control.cancel_turn(request)
