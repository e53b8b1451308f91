"""Approved actions run once, and confirmed conversations continue: the entry point of authz's
tool-call events (durable consumers shared by every runtime replica).

1. ``TOOL_CALL_CLAIMED`` (someone approved): write the action's effect claim, run the handler
   once, settle the claim with the result. A redelivered event finds the effect claim: a recorded
   result is settled again (idempotent in authz); no result means the handler may have run when a
   replica died, so nothing runs and the claim stays for an operator (``parley approvals stuck``,
   then ``settle``).
2. ``TOOL_CALL_SETTLED`` (success, failure, denial, expiry, an operator's settlement): when every
   call of the message is settled, the conversation continues with one message carrying the
   outcomes in call order; its id derives from the prompt, so JetStream's dedup and the ingest
   make it one turn however many replicas see the last settlement.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from google.protobuf.message import DecodeError

from parley.v1 import authz_pb2, runtime_pb2
from parley_platform.consumer import Delivery, Poison
from parley_platform.errors import ParleyError
from parley_platform.logging import get_logger

from ..agents.directory import AgentDirectory, AgentInfo
from ..records import ToolCall
from ..sdk import ActionResult, Content
from ..store import RuntimeStore
from .actions import invoke
from .capabilities import CapabilityGate
from .inbound import Inbound, Origin
from .ports import Ports
from .reply import Reply
from .services import Resources, context
from .state import TurnMetrics

log = get_logger(__name__)

CLAIMED, SETTLED = "TOOL_CALL_CLAIMED", "TOOL_CALL_SETTLED"
CONTINUATION_PREFIX = "confirmations:"
MAX_RESULT_BYTES = 65536
OUTCOMES = {
    authz_pb2.TOOL_OUTCOME_SUCCESS: "done",
    authz_pb2.TOOL_OUTCOME_FAILURE: "failed",
    authz_pb2.TOOL_OUTCOME_INDETERMINATE: "outcome unknown (settled by an operator)",
    authz_pb2.TOOL_OUTCOME_DENIED: "cancelled: not approved",
    authz_pb2.TOOL_OUTCOME_EXPIRED: "cancelled: nobody confirmed it in time",
}
# authz's codes for a settlement that came second (an operator reconciled a stuck claim first).
SETTLED_BY_SOMEONE_ELSE = frozenset({"ACTION_ALREADY_SETTLED", "STALE_CLAIM_TOKEN"})


def proposing_message(agent_id: uuid.UUID, call: ToolCall) -> runtime_pb2.InboundMessage:
    """The message that proposed the call, rebuilt from what the proposal kept of it."""
    i = call.invocation
    return runtime_pb2.InboundMessage(
        agent_id=str(agent_id),
        source=i.source,
        message_id=i.message_id,
        channel_id=i.channel_id,
        sender_id=i.sender_id,
        sender_name=i.sender_name,
        sender_username=i.sender_username,
        room_type=runtime_pb2.RoomType.Value(f"ROOM_TYPE_{i.room_type}"),
        world_id=i.world_id,
        text=i.text,
        in_reply_to=i.in_reply_to,
        metadata=i.metadata,
        attachments=[
            runtime_pb2.Attachment(
                id=a.get("id", ""),
                url=a.get("url", ""),
                title=a.get("title", ""),
                content_type=a.get("contentType", ""),
                text=a.get("text", ""),
            )
            for a in i.attachments
        ],
    )


class Confirmations:
    def __init__(
        self,
        *,
        resources: Resources,
        ports: Ports,
        directory: AgentDirectory,
        metrics: TurnMetrics,
    ) -> None:
        self.resources = resources
        self.store: RuntimeStore = resources.store
        self.ports = ports
        self.directory = directory
        self.metrics = metrics

    async def on_event(self, delivery: Delivery) -> None:
        try:
            event = authz_pb2.ToolCallEvent.FromString(delivery.data)
        except DecodeError as exc:
            raise Poison(f"not a ToolCallEvent: {exc}", label="undecodable") from exc
        call = event.tool_call
        if event.type not in (CLAIMED, SETTLED) or not call.tool_call_id:
            raise Poison(f"unexpected tool-call event type {event.type[:64]!r}", label="invalid")
        agent = await self._agent(call.agent_id)
        if agent is None:
            return
        proposed = await self.store.get_tool_call(agent.id, call.tool_call_id)
        if proposed is None:
            return  # not proposed by the runtime: another executor's call
        if event.type == CLAIMED:
            await self._execute(agent, proposed, call)
        else:
            await self._resume(agent, proposed, call)

    async def _agent(self, agent_id: str) -> AgentInfo | None:
        directory = self.directory
        if agent_id not in directory.agents:
            try:
                uuid.UUID(agent_id)
            except ValueError:
                return None
            await directory.reload(agent_id)
        return directory.agents.get(agent_id)

    async def _execute(self, agent: AgentInfo, proposed: ToolCall, call: authz_pb2.ToolCall) -> None:
        turn_id, index = proposed.turn_id, proposed.action_index
        if not await self.store.claim_effect(agent.id, turn_id, index, proposed.action):
            effect = await self.store.get_effect(agent.id, turn_id, index)
            if effect is None or effect.result is None:
                log.warning(
                    "a confirmed action may have run without a recorded result; it is not run again "
                    "and its claim is left for an operator (parley approvals stuck)",
                    agent_id=str(agent.id),
                    tool_call_id=call.tool_call_id,
                )
                return
            result = ActionResult.from_json(effect.result)  # ran; the settlement was lost
        else:
            result = await self._run(agent, proposed)
            await self.store.complete_effect(
                agent.id, turn_id, index, agent.redactor.redact_obj(result.to_json())
            )
        outcome = authz_pb2.TOOL_OUTCOME_SUCCESS if result.success else authz_pb2.TOOL_OUTCOME_FAILURE
        # Sorted keys: a repeated settlement (from the stored result) sends the same bytes.
        text = json.dumps(
            agent.redactor.redact_obj(result.to_json()), ensure_ascii=False, sort_keys=True, default=str
        )
        try:
            await self.ports.authz.Settle(
                authz_pb2.SettleRequest(
                    agent_id=str(agent.id),
                    tool_call_id=call.tool_call_id,
                    claim_token=call.claim.token,
                    outcome=outcome,
                    result=text.encode()[:MAX_RESULT_BYTES].decode(errors="ignore"),
                    settled_by="runtime",
                )
            )
        except ParleyError as exc:
            if exc.code not in SETTLED_BY_SOMEONE_ELSE:
                raise
            # An operator settled it first (a stuck claim reconciled): theirs is the record.
            log.warning(
                "confirmed action ran but its settlement was refused",
                agent_id=str(agent.id),
                tool_call_id=call.tool_call_id,
                code=exc.code,
            )

    async def _run(self, agent: AgentInfo, proposed: ToolCall) -> ActionResult:
        action = agent.catalog.find(proposed.action)
        if action is None:
            return ActionResult(False, error=f"UNKNOWN_ACTION: {proposed.action} is no longer available")
        message = Inbound(proposing_message(agent.id, proposed), agent.id)
        ctx = context(self.resources, agent, message, role=proposed.role)
        said: list[Content] = []

        async def callback(content: Content) -> None:
            said.append(content)

        events = self.ports.events
        await events.emit(agent, "ACTION_STARTED", proposed.turn_id, proposed.room_id, action=action.name)
        result, outcome = await invoke(
            agent,
            action,
            ctx,
            proposed.params,
            callback,
            gate=CapabilityGate(self.ports.authz),
            decision_id=f"confirmed:{proposed.id}",
        )
        self.metrics.actions.labels(action.name, outcome).inc()
        await events.emit(
            agent, "ACTION_COMPLETED", proposed.turn_id, proposed.room_id, action=action.name, outcome=outcome
        )
        # What the handler said is published under ids derived from the call: a retry repeats them.
        proto = message.proto
        for n, content in enumerate(said):
            reply = Reply.of(
                uuid.uuid5(proposed.turn_id, f"confirmed:{proposed.action_index}:{n}"),
                content,
                source=proto.source,
                channel_id=proto.channel_id,
                in_reply_to=proto.message_id,
            ).redacted(agent.redactor.redact)
            await self.ports.outbox.publish(agent.id, proposed.room_id, reply)
        return result

    async def _resume(self, agent: AgentInfo, proposed: ToolCall, call: authz_pb2.ToolCall) -> None:
        reply = await self.ports.authz.ListMessageToolCalls(
            authz_pb2.ListMessageToolCallsRequest(
                agent_id=str(agent.id), conversation_id=call.conversation_id, message_id=call.message_id
            )
        )
        if not reply.all_settled:
            return
        lines = []
        for c in sorted(reply.tool_calls, key=lambda c: c.call_index):
            line = f"{c.call_index + 1}. {c.tool}: {OUTCOMES.get(c.outcome, 'settled')}"
            detail = _result_text(c.result) if c.outcome != authz_pb2.TOOL_OUTCOME_DENIED else c.reason
            lines.append(f"{line} - {detail[:500]}" if detail else line)
        proposing = proposing_message(agent.id, proposed)
        await self.ports.inbox.publish(
            runtime_pb2.InboundMessage(
                agent_id=str(agent.id),
                source=proposing.source,
                message_id=f"{CONTINUATION_PREFIX}{call.message_id}",
                sender_id=str(agent.id),
                sender_name=agent.character.name,
                channel_id=proposing.channel_id,
                room_type=proposing.room_type,
                world_id=proposing.world_id,
                in_reply_to=proposing.message_id,
                text="The actions waiting for confirmation are finished:\n" + "\n".join(lines),
                metadata={"confirmations_of": call.message_id},
            ),
            Origin.CONTINUATION,
        )


def _result_text(result: str) -> str:
    """The settled result as a person reads it: the action's text or error, else the raw value."""
    try:
        value: Any = json.loads(result)
    except ValueError:
        return result
    if isinstance(value, dict):
        return str(value.get("text") or value.get("error") or "")
    return result
