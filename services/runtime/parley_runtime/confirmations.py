"""Actions that wait for a human decision, through authz's tool-call approvals.

An action tagged ``confirm`` (or named in the agent's ``CONFIRM_ACTIONS`` setting) is not
run by the turn that plans it. The turn records the proposal (``runtime.tool_call``: the
parameters stay in the runtime, authz only sees their digest), puts a pending decision in
authz, replies with a confirmation prompt and ends. Then:

1. someone decides: an operator (``parley approvals approve|deny``) or the user, through the
   CHOICE action (``decide`` below; it never runs the action itself);
2. the approval's ``TOOL_CALL_CLAIMED`` event reaches one runtime replica (a durable
   consumer shared by all), which writes the action's effect claim, runs the handler once
   and settles the claim with the result. A redelivered event finds the effect claim: a
   recorded result is settled again (idempotent in authz); no result means the handler may
   have run when a replica died, so nothing runs and the claim stays for an operator
   (``parley approvals stuck``, then ``settle``);
3. every ``TOOL_CALL_SETTLED`` event (success, failure, denial, expiry, an operator's
   settlement) asks authz whether all the calls of that message are settled; when they are,
   the conversation continues with one autonomous message carrying the results in call
   order. Its id is derived from the proposing message, so however many replicas see the
   last settlement, JetStream's deduplication and the runtime's ingest make it one turn.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from google.protobuf.message import DecodeError, Message

from parley.v1 import authz_pb2, common_pb2, runtime_pb2
from parley_platform import canonical
from parley_platform.consumer import Delivery, Poison
from parley_platform.errors import ParleyError
from parley_platform.logging import get_logger

from . import ids
from .agent_settings import setting_list
from .agents import AgentInfo
from .context import PendingCall
from .plugin import Action, ActionResult, Content

if TYPE_CHECKING:
    from .turn import Turn, TurnProcessor

log = get_logger(__name__)

CONFIRM_ACTIONS_SETTING = "CONFIRM_ACTIONS"
TTL_SETTING = "CONFIRMATION_TTL_SECONDS"
DEFAULT_TTL_SECONDS = 24 * 3600.0
CLAIMED, SETTLED = "TOOL_CALL_CLAIMED", "TOOL_CALL_SETTLED"
CONTINUATION_PREFIX = "confirmations:"
MAX_SUMMARY = 2000
MAX_RESULT_BYTES = 65536
OUTCOMES = {
    authz_pb2.TOOL_OUTCOME_SUCCESS: "done",
    authz_pb2.TOOL_OUTCOME_FAILURE: "failed",
    authz_pb2.TOOL_OUTCOME_INDETERMINATE: "outcome unknown (settled by an operator)",
    authz_pb2.TOOL_OUTCOME_DENIED: "cancelled: not approved",
    authz_pb2.TOOL_OUTCOME_EXPIRED: "cancelled: nobody confirmed it in time",
}
DECIDE_RESULTS = {
    authz_pb2.DECIDE_RESULT_CLAIMED: "approved",
    authz_pb2.DECIDE_RESULT_DENIED: "denied",
    authz_pb2.DECIDE_RESULT_IN_FLIGHT: "already approved",
    authz_pb2.DECIDE_RESULT_RECORDED: "already decided",
}


def needs_confirmation(agent: AgentInfo, action: Action) -> bool:
    if action.needs_confirmation:
        return True
    return action.name in {name.upper() for name in setting_list(agent.setting(CONFIRM_ACTIONS_SETTING))}


def tool_call_id(turn_id: uuid.UUID, action_index: int) -> str:
    return f"{turn_id}:{action_index}"


def arguments_digest(params: Mapping[str, Any]) -> str:
    """The canonical digest of the parameters; canonical JSON refuses fractions, so a float is
    bound by its shortest decimal text."""

    def integral(value: Any) -> Any:
        if isinstance(value, float):
            return repr(value)
        if isinstance(value, Mapping):
            return {str(k): integral(v) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return [integral(v) for v in value]
        return value

    return canonical.tool_arguments_digest(integral(dict(params)))


@dataclass(frozen=True)
class Proposal:
    index: int  # the action's position in the turn's plan
    action: Action
    params: dict[str, Any]


class Confirmations:
    def __init__(self, turns: TurnProcessor) -> None:
        self.turns = turns
        self.store = turns.store

    async def _authz(self, method: str, request: Message, response_type: type[Any]) -> Any:
        return await self.turns.rpc.call(
            "authz", method, request, response_type, timeout=self.turns.settings.model_timeout
        )

    # -- proposing (in the turn) -------------------------------------------------------------

    async def propose(self, turn: Turn) -> Content:
        """Record the turn's proposals, put each in authz, and return the prompt that asks."""
        agent = turn.agent
        message_id = ids.response_id(turn.turn_id, len(turn.replies))
        ttl = float(str(agent.setting(TTL_SETTING) or DEFAULT_TTL_SECONDS))
        lines = []
        for call_index, proposal in enumerate(turn.proposals):
            call_id = tool_call_id(turn.turn_id, proposal.index)
            # A redelivered turn gets the first proposal back: authz hears the same call again.
            row = await self.store.save_tool_call(
                {
                    "agent_id": agent.id,
                    "tool_call_id": call_id,
                    "turn_id": turn.turn_id,
                    "action_index": proposal.index,
                    "call_index": call_index,
                    "room_id": turn.room_id,
                    "message_id": message_id,
                    "action": proposal.action.name,
                    "params": proposal.params,
                    "requester_id": turn.ctx.message.sender_id,
                    "role": turn.ctx.role,
                    "inbound": turn.inbound.SerializeToString(),
                }
            )
            summary = self.summary(agent, row["action"], row["params"])
            request = authz_pb2.PutPendingRequest(
                agent_id=str(agent.id),
                tool_call_id=call_id,
                conversation_id=str(row["room_id"]),
                message_id=str(row["message_id"]),
                call_index=row["call_index"],
                tool=row["action"],
                args_digest=arguments_digest(row["params"]),
                summary=summary,
                on_expiry=authz_pb2.TOOL_DECISION_DENY,
            )
            request.proposed_at.FromDatetime(row["created_at"])
            request.expires_at.FromDatetime(row["created_at"] + timedelta(seconds=ttl))
            await self._authz("PutPending", request, authz_pb2.PutPendingResponse)
            lines.append(f"{row['call_index'] + 1}. {summary} (approval id {call_id})")
        await self.turns.emit(
            agent, "CONFIRMATION_REQUESTED", turn.turn_id, turn.room_id, calls=str(len(lines))
        )
        text = (
            "Before I go ahead I need your confirmation:\n"
            + "\n".join(lines)
            + "\nAnswer yes to go ahead or no to cancel."
        )
        return Content(text=text, actions=("CONFIRM",))

    @staticmethod
    def summary(agent: AgentInfo, action: str, params: Mapping[str, Any]) -> str:
        """What a person approves: the action and its parameters, secrets redacted."""
        shown = json.dumps(params, ensure_ascii=False, sort_keys=True, default=str)
        text = agent.redactor.redact(f"{action} {shown}" if params else action)
        return text if len(text) <= MAX_SUMMARY else text[: MAX_SUMMARY - 1] + "…"

    # -- deciding (the CHOICE action) --------------------------------------------------------

    async def pending(self, agent: AgentInfo, room_id: uuid.UUID) -> list[PendingCall]:
        reply = await self._authz(
            "ListPendingToolCalls",
            authz_pb2.ListPendingToolCallsRequest(
                agent_id=str(agent.id), conversation_id=str(room_id), page=common_pb2.PageRequest(limit=100)
            ),
            authz_pb2.ListToolCallsResponse,
        )
        calls = list(reply.tool_calls)
        rows = {
            r["tool_call_id"]: r
            for r in await self.store.get_tool_calls(agent.id, [c.tool_call_id for c in calls])
        }
        return [
            PendingCall(c.tool_call_id, c.tool, c.summary, str(rows[c.tool_call_id]["requester_id"]))
            for c in calls
            if c.tool_call_id in rows  # proposed by this runtime, not by another executor
        ]

    async def decide(
        self, agent: AgentInfo, call_id: str, *, approve: bool, reason: str, decided_by: str
    ) -> str:
        """Record the decision; the approval's event, not this reply, makes the action run."""
        reply = await self._authz(
            "Decide",
            authz_pb2.DecideRequest(
                agent_id=str(agent.id),
                tool_call_id=call_id,
                decision=authz_pb2.TOOL_DECISION_APPROVE if approve else authz_pb2.TOOL_DECISION_DENY,
                reason=reason,
                decided_by=decided_by,
            ),
            authz_pb2.DecideResponse,
        )
        return DECIDE_RESULTS.get(reply.result, "decided")

    # -- executing and resuming (the tool-call event consumers) ------------------------------

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
        row = await self.store.get_tool_call(agent.id, call.tool_call_id)
        if row is None:
            return  # not proposed by the runtime: another executor's call
        if event.type == CLAIMED:
            await self._execute(agent, row, call)
        else:
            await self._resume(agent, row, call)

    async def _agent(self, agent_id: str) -> AgentInfo | None:
        directory = self.turns.directory
        if agent_id not in directory.agents:
            try:
                uuid.UUID(agent_id)
            except ValueError:
                return None
            await directory.reload(agent_id)
        return directory.agents.get(agent_id)

    async def _execute(self, agent: AgentInfo, row: Mapping[str, Any], call: authz_pb2.ToolCall) -> None:
        turn_id, index, name = row["turn_id"], row["action_index"], row["action"]
        if not await self.store.claim_effect(agent.id, turn_id, index, name):
            existing = await self.store.get_effect(agent.id, turn_id, index)
            if existing is None or existing["result"] is None:
                log.warning(
                    "a confirmed action may have run without a recorded result; it is not run again "
                    "and its claim is left for an operator (parley approvals stuck)",
                    agent_id=str(agent.id),
                    tool_call_id=call.tool_call_id,
                )
                return
            result = ActionResult.from_json(existing["result"])  # ran; the settlement was lost
        else:
            result = await self._run(agent, row)
            await self.store.complete_effect(
                agent.id, turn_id, index, agent.redactor.redact_obj(result.to_json())
            )
        outcome = authz_pb2.TOOL_OUTCOME_SUCCESS if result.success else authz_pb2.TOOL_OUTCOME_FAILURE
        # Sorted keys: a repeated settlement (from the stored result) sends the same bytes.
        text = json.dumps(
            agent.redactor.redact_obj(result.to_json()), ensure_ascii=False, sort_keys=True, default=str
        )
        try:
            await self._authz(
                "Settle",
                authz_pb2.SettleRequest(
                    agent_id=str(agent.id),
                    tool_call_id=call.tool_call_id,
                    claim_token=call.claim.token,
                    outcome=outcome,
                    result=text.encode()[:MAX_RESULT_BYTES].decode(errors="ignore"),
                    settled_by="runtime",
                ),
                authz_pb2.ToolCall,
            )
        except ParleyError as exc:
            if exc.code not in ("ACTION_ALREADY_SETTLED", "STALE_CLAIM_TOKEN"):
                raise
            # An operator settled it first (a stuck claim reconciled): theirs is the record.
            log.warning(
                "confirmed action ran but its settlement was refused",
                agent_id=str(agent.id),
                tool_call_id=call.tool_call_id,
                code=exc.code,
            )

    async def _run(self, agent: AgentInfo, row: Mapping[str, Any]) -> ActionResult:
        action = agent.catalog.find(row["action"])
        if action is None:
            return ActionResult(False, error=f"UNKNOWN_ACTION: {row['action']} is no longer available")
        inbound = runtime_pb2.InboundMessage.FromString(row["inbound"])
        ctx = self.turns.context(agent, inbound, row["turn_id"], role=row["role"])
        said: list[Content] = []

        async def callback(content: Content) -> None:
            said.append(content)

        await self.turns.emit(agent, "ACTION_STARTED", row["turn_id"], row["room_id"], action=action.name)
        result, outcome = await self.turns.invoke(agent, action, ctx, row["params"], callback)
        self.turns.metrics.actions.labels(action.name, outcome).inc()
        await self.turns.emit(
            agent, "ACTION_COMPLETED", row["turn_id"], row["room_id"], action=action.name, outcome=outcome
        )
        # What the handler said is published under ids derived from the call: a retry repeats them.
        for n, content in enumerate(said):
            reply: dict[str, Any] = {
                "text": agent.redactor.redact(content.text),
                "actions": list(content.actions),
                "thought": agent.redactor.redact(content.thought),
            }
            if content.target_channel:
                reply["targetChannel"] = content.target_channel
            response_id = uuid.uuid5(row["turn_id"], f"confirmed:{row['action_index']}:{n}")
            await self.turns.publish_reply(inbound, agent, row["room_id"], response_id, reply)
        return result

    async def _resume(self, agent: AgentInfo, row: Mapping[str, Any], call: authz_pb2.ToolCall) -> None:
        reply = await self._authz(
            "ListMessageToolCalls",
            authz_pb2.ListMessageToolCallsRequest(
                agent_id=str(agent.id), conversation_id=call.conversation_id, message_id=call.message_id
            ),
            authz_pb2.ListMessageToolCallsResponse,
        )
        if not reply.all_settled:
            return
        lines = []
        for c in sorted(reply.tool_calls, key=lambda c: c.call_index):
            line = f"{c.call_index + 1}. {c.tool}: {OUTCOMES.get(c.outcome, 'settled')}"
            detail = _result_text(c.result) if c.outcome != authz_pb2.TOOL_OUTCOME_DENIED else c.reason
            lines.append(f"{line} - {detail[:500]}" if detail else line)
        inbound = runtime_pb2.InboundMessage.FromString(row["inbound"])
        continuation = runtime_pb2.InboundMessage(
            agent_id=str(agent.id),
            source=inbound.source,
            message_id=f"{CONTINUATION_PREFIX}{call.message_id}",
            sender_id=str(agent.id),
            sender_name=agent.character.name,
            channel_id=inbound.channel_id,
            room_type=inbound.room_type,
            world_id=inbound.world_id,
            in_reply_to=inbound.message_id,
            text="The actions waiting for confirmation are finished:\n" + "\n".join(lines),
            metadata={"is_autonomous": "true", "confirmations_of": call.message_id},
        )
        bus = self.turns.bus
        await bus.publish(
            bus.subjects.inbound(str(agent.id)),
            continuation.SerializeToString(),
            msg_id=f"{continuation.source}:{continuation.message_id}",
        )


def _result_text(result: str) -> str:
    """The settled result as a person reads it: the action's text or error, else the raw value."""
    try:
        value = json.loads(result)
    except ValueError:
        return result
    if isinstance(value, dict):
        return str(value.get("text") or value.get("error") or "")
    return result
