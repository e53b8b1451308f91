"""Tool-call decisions: propose, decide (the claim), settle, list; and the sweeper's expiry."""

from __future__ import annotations

import math
import uuid
from datetime import UTC, datetime

from parley.v1 import authz_pb2
from parley_platform import codes
from parley_platform.convert import uuid_or_none
from parley_platform.errors import ParleyError
from parley_platform.logging import get_logger
from parley_platform.paging import cut, page_of

from .. import domain, errors, validate
from ..model import DECISION_NAMES, SETTLE_OUTCOMES, Proposal, Settlement, ToolCall, Verdict
from .edge import Handlers, lenient_time, strict

log = get_logger(__name__)

MAX_CALL_INDEX = 2**31 - 1
MAX_STUCK_SECONDS = 365 * 24 * 3600


class ToolCalls(Handlers):
    def announce_later(self, call: ToolCall, message: authz_pb2.ToolCall | None = None) -> None:
        """Publish the decision's event after the reply (see events.py)."""
        if self.announcer is not None:
            self.announcer.push(call, message)

    def observe_decision(self, call: ToolCall, outcome: str) -> None:
        self.metrics.decisions.labels("tool_call", outcome).inc()
        if call.decided_at is not None:
            waited = (call.decided_at - call.proposed_at).total_seconds()
            self.metrics.time_to_decide.observe(max(0.0, waited))

    @strict
    async def PutPending(self, request: authz_pb2.PutPendingRequest) -> authz_pb2.PutPendingResponse:
        agent_id = validate.agent_uuid(request.agent_id)
        proposed_at = lenient_time(request, "proposed_at", "proposed_at")
        expires_at = lenient_time(request, "expires_at", "expires_at")
        if expires_at is not None and expires_at <= (proposed_at or datetime.now(UTC)):
            raise codes.INVALID_ARGUMENT("expires_at must be after proposed_at")
        if request.on_expiry not in (0, *DECISION_NAMES):
            raise codes.INVALID_ARGUMENT("on_expiry must be approve or deny")
        proposal = Proposal(
            agent_id=agent_id,
            id=validate.opaque_id(request.tool_call_id, "tool_call_id"),
            conversation_id=validate.opaque_id(request.conversation_id, "conversation_id"),
            message_id=validate.opaque_id(request.message_id, "message_id"),
            call_index=request.call_index,
            tool=validate.name(request.tool, "tool"),
            args_digest=validate.hex_digest(request.args_digest, "args_digest", contract=False),
            summary=validate.text(request.summary, "summary"),
            proposed_at=proposed_at,
            expires_at=expires_at,
            on_expiry=DECISION_NAMES.get(request.on_expiry, self.expiry_decision),
        )
        if request.call_index > MAX_CALL_INDEX:
            raise codes.INVALID_ARGUMENT("call_index must be at most 2^31-1")
        stored = await self.store.put_pending(proposal)
        if stored is None:  # a concurrent first insert of the same call just committed
            call = await self.store.get_tool_call(agent_id, proposal.id)
            if call is None:
                raise errors.PUT_RACE("the tool call changed while recording it")
            stored = (call, False)
        call, created = stored
        if not created:
            domain.check_same_proposal(call, proposal)
        return authz_pb2.PutPendingResponse(tool_call=call.to_proto(), created=created)

    @strict
    async def GetToolCall(self, request: authz_pb2.GetToolCallRequest) -> authz_pb2.ToolCall:
        agent_id = validate.agent_uuid(request.agent_id)
        call = await self.store.get_tool_call(
            agent_id, validate.opaque_id(request.tool_call_id, "tool_call_id")
        )
        if call is None:
            raise domain.action_not_found()
        return call.to_proto()

    @strict
    async def Decide(self, request: authz_pb2.DecideRequest) -> authz_pb2.DecideResponse:
        agent_id = validate.agent_uuid(request.agent_id)
        tool_call_id = validate.opaque_id(request.tool_call_id, "tool_call_id")
        decision = DECISION_NAMES.get(request.decision)
        if decision is None:
            raise codes.INVALID_ARGUMENT("decision must be approve or deny")
        verdict = Verdict(
            agent_id=agent_id,
            id=tool_call_id,
            decision=decision,
            reason=validate.text(request.reason, "reason") or None,
            decided_by=validate.opaque_id(request.decided_by, "decided_by"),
            claim_token=uuid.uuid4() if decision == "approve" else None,
        )
        call = await self.store.decide(verdict)
        if call is not None:
            result = "claimed" if decision == "approve" else "denied"
            self.observe_decision(call, result)
            # The winner's answer and the event carry the same record, claim included.
            message = call.to_proto(with_claim=True)
            self.announce_later(call, message)
            log.info(
                "tool call decided", agent_id=str(agent_id), tool_call_id=tool_call_id, decision=decision
            )
            return authz_pb2.DecideResponse(
                result=authz_pb2.DECIDE_RESULT_CLAIMED
                if result == "claimed"
                else authz_pb2.DECIDE_RESULT_DENIED,
                tool_call=message,
            )
        self.metrics.claim_conflicts.inc()
        try:
            answer = domain.why_not_decided(await self.store.get_tool_call(agent_id, tool_call_id), decision)
        except ParleyError as exc:
            self.metrics.decisions.labels("tool_call", exc.code.lower()).inc()
            raise
        self.metrics.decisions.labels("tool_call", answer.result).inc()
        return authz_pb2.DecideResponse(
            result=(
                authz_pb2.DECIDE_RESULT_IN_FLIGHT
                if answer.result == "in_flight"
                else authz_pb2.DECIDE_RESULT_RECORDED
            ),
            tool_call=answer.call.to_proto(),
        )

    @strict
    async def Settle(self, request: authz_pb2.SettleRequest) -> authz_pb2.ToolCall:
        agent_id = validate.agent_uuid(request.agent_id)
        tool_call_id = validate.opaque_id(request.tool_call_id, "tool_call_id")
        claim_token = uuid_or_none(request.claim_token)
        if claim_token is None:
            raise codes.INVALID_ARGUMENT("claim_token must be the UUID of the claim")
        outcome = SETTLE_OUTCOMES.get(request.outcome)
        if outcome is None:
            raise codes.INVALID_ARGUMENT("outcome must be success, failure or indeterminate")
        if len(request.result.encode()) > domain.MAX_RESULT_BYTES:
            raise codes.INVALID_ARGUMENT(f"result must be at most {domain.MAX_RESULT_BYTES} bytes")
        settlement = Settlement(
            agent_id=agent_id,
            id=tool_call_id,
            claim_token=claim_token,
            outcome=outcome,
            result=request.result,
            settled_by=validate.opaque_id(request.settled_by, "settled_by"),
        )
        call = await self.store.settle(settlement)
        if call is not None:
            settled = call.to_proto()
            self.announce_later(call, settled)
            log.info("tool call settled", agent_id=str(agent_id), tool_call_id=tool_call_id, outcome=outcome)
            return settled
        current = await self.store.get_tool_call(agent_id, tool_call_id)
        return domain.why_not_settled(current, claim_token, outcome, request.result).to_proto()

    @strict
    async def ListPendingToolCalls(
        self, request: authz_pb2.ListPendingToolCallsRequest
    ) -> authz_pb2.ListToolCallsResponse:
        agent_id = validate.agent_uuid(request.agent_id)
        conversation = validate.opaque_id(request.conversation_id, "conversation_id", required=False) or None
        page = page_of(request.page if request.HasField("page") else None)
        calls, page_response = cut(
            page, await self.store.list_pending(agent_id, conversation, page.fetch, page.offset)
        )
        return authz_pb2.ListToolCallsResponse(tool_calls=[c.to_proto() for c in calls], page=page_response)

    @strict
    async def ListStuckToolCalls(
        self, request: authz_pb2.ListStuckToolCallsRequest
    ) -> authz_pb2.ListToolCallsResponse:
        agent_id = validate.agent_uuid(request.agent_id)
        older_than = request.older_than_seconds
        if not math.isfinite(older_than) or not 0 <= older_than <= MAX_STUCK_SECONDS:
            raise codes.INVALID_ARGUMENT("older_than_seconds must be from 0 to one year")
        page = page_of(request.page if request.HasField("page") else None)
        calls, page_response = cut(
            page, await self.store.list_stuck(agent_id, older_than, page.fetch, page.offset)
        )
        # The operators' reconciliation view: it carries the claim token they settle with.
        messages = [c.to_proto(with_claim=True) for c in calls]
        return authz_pb2.ListToolCallsResponse(tool_calls=messages, page=page_response)

    @strict
    async def ListMessageToolCalls(
        self, request: authz_pb2.ListMessageToolCallsRequest
    ) -> authz_pb2.ListMessageToolCallsResponse:
        agent_id = validate.agent_uuid(request.agent_id)
        calls = await self.store.list_message(
            agent_id,
            validate.opaque_id(request.conversation_id, "conversation_id"),
            validate.opaque_id(request.message_id, "message_id"),
        )
        decided, settled = domain.conversation_status(calls)
        return authz_pb2.ListMessageToolCallsResponse(
            tool_calls=[c.to_proto() for c in calls], all_decided=decided, all_settled=settled
        )

    async def expire_due(self, limit: int = 100) -> int:
        """Give due pending calls their expiry decision; returns how many. Called by the sweeper."""
        calls = await self.store.expire_due(limit)
        for call in calls:
            self.observe_decision(call, "expired" if call.decision == "deny" else "expired_approved")
            self.announce_later(call)
            log.info(
                "tool call expired", agent_id=str(call.agent_id), tool_call_id=call.id, decision=call.decision
            )
        return len(calls)

    async def republish(self, grace: float, limit: int = 100) -> int:
        """Publish again the events of decisions that were never recorded as published."""
        calls = await self.store.unannounced(grace, limit)
        if self.announcer is None or not calls:
            return 0
        return await self.announcer.publish(calls)
