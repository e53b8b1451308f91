"""The ``parley.v1.Authz`` service, served over gRPC and NATS: validate, one statement, answer."""

from __future__ import annotations

import functools
import math
import time
import uuid
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import Any, TypeVar

from google.protobuf.message import Message
from google.protobuf.timestamp_pb2 import Timestamp

from parley.v1 import authz_pb2
from parley_platform import canonical, codes
from parley_platform.bus import Bus
from parley_platform.canonical import InvalidContract
from parley_platform.errors import Conflict, ParleyError
from parley_platform.logging import get_logger
from parley_platform.paging import cut, page_of

from . import contracts, domain, errors
from .domain import Row
from .events import Announcer
from .metrics import AuthzMetrics
from .store import AuthzStore

log = get_logger(__name__)

STATUSES = {
    "pending": authz_pb2.TOOL_CALL_STATUS_PENDING,
    "claimed": authz_pb2.TOOL_CALL_STATUS_CLAIMED,
    "settled": authz_pb2.TOOL_CALL_STATUS_SETTLED,
}
DECISIONS = {"approve": authz_pb2.TOOL_DECISION_APPROVE, "deny": authz_pb2.TOOL_DECISION_DENY}
DECISION_NAMES = {value: key for key, value in DECISIONS.items()}
OUTCOMES = {
    "success": authz_pb2.TOOL_OUTCOME_SUCCESS,
    "failure": authz_pb2.TOOL_OUTCOME_FAILURE,
    "indeterminate": authz_pb2.TOOL_OUTCOME_INDETERMINATE,
    "denied": authz_pb2.TOOL_OUTCOME_DENIED,
    "expired": authz_pb2.TOOL_OUTCOME_EXPIRED,
}
SETTLE_OUTCOMES = {OUTCOMES[name]: name for name in ("success", "failure", "indeterminate")}
INTERACTION_STATES = {
    "pending": authz_pb2.INTERACTION_CONFIRMATION_STATE_PENDING,
    "issued": authz_pb2.INTERACTION_CONFIRMATION_STATE_ISSUED,
    "consumed": authz_pb2.INTERACTION_CONFIRMATION_STATE_CONSUMED,
}

Req = TypeVar("Req", bound=Message)
Resp = TypeVar("Resp", bound=Message)


def strict(method: Callable[[Any, Req], Awaitable[Resp]]) -> Callable[[Any, Req], Awaitable[Resp]]:
    """Refuse a request carrying fields this service does not know before anything else."""

    @functools.wraps(method)
    async def checked(self: Any, request: Req) -> Resp:
        contracts.check_known_fields(request)
        return await method(self, request)

    return checked


def _ts(value: datetime | None) -> Timestamp | None:
    if value is None:
        return None
    ts = Timestamp()
    ts.FromDatetime(value)
    return ts


def _now_ms() -> datetime:
    """This service's clock, to the millisecond (what enters canonical documents)."""
    return datetime.fromtimestamp(math.floor(time.time() * 1000) / 1000, tz=UTC)


def _lenient_time(message: Message, name: str, field: str) -> datetime | None:
    """An optional timestamp that enters no digest: any precision."""
    if not message.HasField(name):
        return None
    ts: Timestamp = getattr(message, name)
    if not 0 <= ts.seconds <= contracts.MAX_TIMESTAMP_SECONDS:
        raise codes.INVALID_ARGUMENT(f"{field} must be between 1970 and 9999")
    return ts.ToDatetime(tzinfo=UTC)


def tool_call_proto(row: Row, *, with_claim: bool = False) -> authz_pb2.ToolCall:
    call = authz_pb2.ToolCall(
        agent_id=str(row["agent_id"]),
        tool_call_id=row["id"],
        conversation_id=row["conversation_id"],
        message_id=row["message_id"],
        call_index=row["call_index"],
        tool=row["tool"],
        args_digest=row["args_digest"],
        summary=row["summary"],
        proposed_at=_ts(row["proposed_at"]),
        expires_at=_ts(row["expires_at"]),
        on_expiry=DECISIONS[row["on_expiry"]],
        status=STATUSES[row["status"]],
        decision=DECISIONS.get(row["decision"] or "", authz_pb2.TOOL_DECISION_UNSPECIFIED),
        reason=row["reason"] or "",
        decided_by=row["decided_by"] or "",
        decided_at=_ts(row["decided_at"]),
        outcome=OUTCOMES.get(row["outcome"] or "", authz_pb2.TOOL_OUTCOME_UNSPECIFIED),
        result=row["result"] or "",
        settled_by=row["settled_by"] or "",
        settled_at=_ts(row["settled_at"]),
    )
    if with_claim and row["claim_token"] is not None:
        call.claim.CopyFrom(
            authz_pb2.ToolCallClaim(token=str(row["claim_token"]), claimed_at=_ts(row["claimed_at"]))
        )
    return call


def lease_proto(row: Row) -> authz_pb2.InteractionLease:
    return authz_pb2.InteractionLease(
        agent_id=str(row["agent_id"]),
        lease_id=row["lease_id"],
        resource=authz_pb2.LeaseResource(kind=row["resource_kind"], id=row["resource_id"]),
        session_id=row["session_id"],
        owner=row["owner"],
        generation=row["generation"],
        fencing_token=row["fencing_token"],
        acquired_at=_ts(row["acquired_at"]),
        renewed_at=_ts(row["renewed_at"]),
        expires_at=_ts(row["expires_at"]),
    )


def interaction_proto(row: Row) -> authz_pb2.InteractionConfirmation:
    return authz_pb2.InteractionConfirmation(
        agent_id=str(row["agent_id"]),
        confirmation_id=row["confirmation_id"],
        action_digest=row["action_digest"],
        state=INTERACTION_STATES[row["state"]],
        grant_id=row["grant_id"] or "",
        created_at=_ts(row["created_at"]),
        expires_at=_ts(row["expires_at"]),
    )


class AuthzApi:
    def __init__(
        self, *, store: AuthzStore, bus: Bus | None, metrics: AuthzMetrics, expiry_decision: str = "deny"
    ) -> None:
        self.store = store
        self.bus = bus
        self.metrics = metrics
        self.expiry_decision = expiry_decision
        self.announcer = Announcer(bus, store, tool_call_proto) if bus is not None else None

    # ----- events ---------------------------------------------------------------

    def announce_later(self, row: Row, tool_call: authz_pb2.ToolCall | None = None) -> None:
        """Publish the decision's event after the reply (see events.py)."""
        if self.announcer is not None:
            self.announcer.push(row, tool_call)

    async def drain_announcements(self, timeout: float) -> None:
        if self.announcer is not None:
            await self.announcer.drain(timeout)

    async def aclose(self) -> None:
        if self.announcer is not None:
            await self.announcer.drain(5)
            await self.announcer.close()

    def observe_decision(self, row: Row, outcome: str) -> None:
        self.metrics.decisions.labels("tool_call", outcome).inc()
        if row["decided_at"] is not None:
            waited = (row["decided_at"] - row["proposed_at"]).total_seconds()
            self.metrics.time_to_decide.observe(max(0.0, waited))

    # ----- 1. tool-call decisions ---------------------------------------------------

    @strict
    async def PutPending(self, request: authz_pb2.PutPendingRequest) -> authz_pb2.PutPendingResponse:
        agent_id = domain.agent_uuid(request.agent_id)
        proposed_at = _lenient_time(request, "proposed_at", "proposed_at")
        expires_at = _lenient_time(request, "expires_at", "expires_at")
        if expires_at is not None and expires_at <= (proposed_at or datetime.now(UTC)):
            raise codes.INVALID_ARGUMENT("expires_at must be after proposed_at")
        if request.on_expiry not in (0, *DECISION_NAMES):
            raise codes.INVALID_ARGUMENT("on_expiry must be approve or deny")
        params: dict[str, Any] = {
            "agent_id": agent_id,
            "id": domain.opaque_id(request.tool_call_id, "tool_call_id"),
            "conversation_id": domain.opaque_id(request.conversation_id, "conversation_id"),
            "message_id": domain.opaque_id(request.message_id, "message_id"),
            "call_index": request.call_index,
            "tool": domain.name(request.tool, "tool"),
            "args_digest": domain.hex_digest(request.args_digest, "args_digest", contract=False),
            "summary": domain.text(request.summary, "summary"),
            "proposed_at": proposed_at,
            "expires_at": expires_at,
            "on_expiry": DECISION_NAMES.get(request.on_expiry, self.expiry_decision),
        }
        if request.call_index > 2**31 - 1:
            raise codes.INVALID_ARGUMENT("call_index must be at most 2^31-1")
        row = await self.store.put_pending(params)
        if row is None:  # a concurrent first insert of the same call just committed
            row = await self.store.get_tool_call(agent_id, params["id"])
            if row is None:
                raise errors.PUT_RACE("the tool call changed while recording it")
            row = {**row, "created": False}
        if not row["created"]:
            for field in ("conversation_id", "message_id", "call_index", "tool", "args_digest"):
                if row[field] != params[field]:
                    raise errors.TOOL_CALL_ID_REUSED(
                        f"tool_call_id is already used by another call (its {field} differs)"
                    )
        return authz_pb2.PutPendingResponse(tool_call=tool_call_proto(row), created=row["created"])

    @strict
    async def GetToolCall(self, request: authz_pb2.GetToolCallRequest) -> authz_pb2.ToolCall:
        agent_id = domain.agent_uuid(request.agent_id)
        row = await self.store.get_tool_call(agent_id, domain.opaque_id(request.tool_call_id, "tool_call_id"))
        if row is None:
            raise domain.action_not_found()
        return tool_call_proto(row)

    @strict
    async def Decide(self, request: authz_pb2.DecideRequest) -> authz_pb2.DecideResponse:
        agent_id = domain.agent_uuid(request.agent_id)
        tool_call_id = domain.opaque_id(request.tool_call_id, "tool_call_id")
        decision = DECISION_NAMES.get(request.decision)
        if decision is None:
            raise codes.INVALID_ARGUMENT("decision must be approve or deny")
        params = {
            "agent_id": agent_id,
            "id": tool_call_id,
            "decision": decision,
            "reason": domain.text(request.reason, "reason") or None,
            "decided_by": domain.opaque_id(request.decided_by, "decided_by"),
            "claim_token": uuid.uuid4() if decision == "approve" else None,
        }
        row = await self.store.decide(params)
        if row is not None:
            result = "claimed" if decision == "approve" else "denied"
            self.observe_decision(row, result)
            # The winner's answer and the event carry the same record, claim included.
            tool_call = tool_call_proto(row, with_claim=True)
            self.announce_later(row, tool_call)
            log.info(
                "tool call decided", agent_id=str(agent_id), tool_call_id=tool_call_id, decision=decision
            )
            return authz_pb2.DecideResponse(
                result=authz_pb2.DECIDE_RESULT_CLAIMED
                if result == "claimed"
                else authz_pb2.DECIDE_RESULT_DENIED,
                tool_call=tool_call,
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
            tool_call=tool_call_proto(answer.row),
        )

    @strict
    async def Settle(self, request: authz_pb2.SettleRequest) -> authz_pb2.ToolCall:
        agent_id = domain.agent_uuid(request.agent_id)
        tool_call_id = domain.opaque_id(request.tool_call_id, "tool_call_id")
        try:
            claim_token = uuid.UUID(request.claim_token)
        except ValueError:
            raise codes.INVALID_ARGUMENT("claim_token must be the UUID of the claim") from None
        outcome = SETTLE_OUTCOMES.get(request.outcome)
        if outcome is None:
            raise codes.INVALID_ARGUMENT("outcome must be success, failure or indeterminate")
        if len(request.result.encode()) > domain.MAX_RESULT_BYTES:
            raise codes.INVALID_ARGUMENT(f"result must be at most {domain.MAX_RESULT_BYTES} bytes")
        params = {
            "agent_id": agent_id,
            "id": tool_call_id,
            "claim_token": claim_token,
            "outcome": outcome,
            "result": request.result,
            "settled_by": domain.opaque_id(request.settled_by, "settled_by"),
        }
        row = await self.store.settle(params)
        if row is not None:
            settled = tool_call_proto(row)
            self.announce_later(row, settled)
            log.info("tool call settled", agent_id=str(agent_id), tool_call_id=tool_call_id, outcome=outcome)
            return settled
        current = await self.store.get_tool_call(agent_id, tool_call_id)
        return tool_call_proto(domain.why_not_settled(current, claim_token, outcome, request.result))

    @strict
    async def ListPendingToolCalls(
        self, request: authz_pb2.ListPendingToolCallsRequest
    ) -> authz_pb2.ListToolCallsResponse:
        agent_id = domain.agent_uuid(request.agent_id)
        conversation = domain.opaque_id(request.conversation_id, "conversation_id", required=False) or None
        page = page_of(request.page if request.HasField("page") else None)
        rows, page_response = cut(
            page, await self.store.list_pending(agent_id, conversation, page.fetch, page.offset)
        )
        return authz_pb2.ListToolCallsResponse(
            tool_calls=[tool_call_proto(r) for r in rows], page=page_response
        )

    @strict
    async def ListStuckToolCalls(
        self, request: authz_pb2.ListStuckToolCallsRequest
    ) -> authz_pb2.ListToolCallsResponse:
        agent_id = domain.agent_uuid(request.agent_id)
        older_than = request.older_than_seconds
        if not math.isfinite(older_than) or not 0 <= older_than <= 365 * 24 * 3600:
            raise codes.INVALID_ARGUMENT("older_than_seconds must be from 0 to one year")
        page = page_of(request.page if request.HasField("page") else None)
        rows, page_response = cut(
            page, await self.store.list_stuck(agent_id, older_than, page.fetch, page.offset)
        )
        # The operators' reconciliation view: it carries the claim token they settle with.
        calls = [tool_call_proto(r, with_claim=True) for r in rows]
        return authz_pb2.ListToolCallsResponse(tool_calls=calls, page=page_response)

    @strict
    async def ListMessageToolCalls(
        self, request: authz_pb2.ListMessageToolCallsRequest
    ) -> authz_pb2.ListMessageToolCallsResponse:
        agent_id = domain.agent_uuid(request.agent_id)
        rows = await self.store.list_message(
            agent_id,
            domain.opaque_id(request.conversation_id, "conversation_id"),
            domain.opaque_id(request.message_id, "message_id"),
        )
        decided, settled = domain.conversation_status(rows)
        return authz_pb2.ListMessageToolCallsResponse(
            tool_calls=[tool_call_proto(r) for r in rows], all_decided=decided, all_settled=settled
        )

    async def expire_due(self, limit: int = 100) -> int:
        """Give due pending calls their expiry decision; returns how many. Called by the sweeper."""
        rows = await self.store.expire_due(limit)
        for row in rows:
            self.observe_decision(row, "expired" if row["decision"] == "deny" else "expired_approved")
            self.announce_later(row)
            log.info(
                "tool call expired",
                agent_id=str(row["agent_id"]),
                tool_call_id=row["id"],
                decision=row["decision"],
            )
        return len(rows)

    async def republish(self, grace: float, limit: int = 100) -> int:
        """Publish again the events of decisions that were never recorded as published."""
        rows = await self.store.unannounced(grace, limit)
        if self.announcer is None or not rows:
            return 0
        return await self.announcer.publish(rows)

    # ----- 2. capability authorization ---------------------------------------------

    @strict
    async def PutAccountSnapshot(
        self, request: authz_pb2.PutAccountSnapshotRequest
    ) -> authz_pb2.PutAccountSnapshotResponse:
        agent_id = domain.agent_uuid(request.agent_id, contract=True)
        account_id = domain.opaque_id(request.account_id, "account_id", contract=True)
        version = domain.opaque_id(request.snapshot_version, "snapshot_version", contract=True)
        row = await self.store.put_account_snapshot(agent_id, account_id, version)
        if not row["created"] and not row["current"]:
            raise errors.SNAPSHOT_VERSION_RETIRED(
                "snapshot_version was current before and has been replaced or revoked"
            )
        return authz_pb2.PutAccountSnapshotResponse(created=row["created"])

    @strict
    async def RevokeAccountSnapshot(
        self, request: authz_pb2.RevokeAccountSnapshotRequest
    ) -> authz_pb2.RevokeAccountSnapshotResponse:
        agent_id = domain.agent_uuid(request.agent_id, contract=True)
        account_id = domain.opaque_id(request.account_id, "account_id", contract=True)
        revoked = await self.store.revoke_account_snapshot(agent_id, account_id)
        if revoked:
            log.info("account snapshot revoked", agent_id=str(agent_id))
        return authz_pb2.RevokeAccountSnapshotResponse(revoked=revoked)

    @strict
    async def BindCapabilityRequest(
        self, request: authz_pb2.BindCapabilityRequestRequest
    ) -> authz_pb2.BindCapabilityRequestResponse:
        catalog = contracts.risk(request.catalog_risk, "catalog_risk")
        contextual = (
            contracts.risk(request.contextual_risk, "contextual_risk") if request.contextual_risk else None
        )
        bound = authz_pb2.CapabilityRequest(
            version=contracts.VERSION,
            agent_id=str(domain.agent_uuid(request.agent_id, contract=True)),
            account_id=domain.opaque_id(request.account_id, "account_id", contract=True),
            snapshot_version=domain.opaque_id(request.snapshot_version, "snapshot_version", contract=True),
            capability=domain.name(request.capability, "capability", contract=True),
            operation=domain.name(request.operation, "operation", contract=True),
            catalog_risk=request.catalog_risk,
            risk=authz_pb2.RiskLevel.Value("RISK_LEVEL_" + domain.bound_risk(catalog, contextual)),
            input_digest=domain.hex_digest(request.input_digest, "input_digest"),
            bound_at=_ts(_now_ms()),
        )
        document = canonical.request_document(bound)
        return authz_pb2.BindCapabilityRequestResponse(
            request=bound,
            request_digest=canonical.request_digest(bound),
            canonical_json=canonical.canonical_json(document).decode("utf-8"),
        )

    @strict
    async def RegisterDecision(
        self, request: authz_pb2.RegisterDecisionRequest
    ) -> authz_pb2.RegisterDecisionResponse:
        if not request.HasField("request"):
            raise InvalidContract("request is required")
        if not request.HasField("decision"):
            raise InvalidContract("decision is required")
        bound = contracts.capability_request(request.request)
        decision = contracts.policy_decision(request.decision, bound)
        if decision.outcome not in ("allowed", "confirmation_required"):
            error = domain.refused_outcome(
                decision.outcome, decision.denial_code, decision.unavailable_code, decision.retryable
            )
            self.metrics.decisions.labels("capability", error.code.lower()).inc()
            raise error
        params: dict[str, Any] = {
            "agent_id": bound.agent_id,
            "decision_id": decision.decision_id,
            "confirmation_id": decision.confirmation_id,
            "id_count": 2 if decision.confirmation_id else 1,
            "decision_digest": decision.digest,
            "request_digest": bound.digest,
            "outcome": decision.outcome,
            "account_id": bound.account_id,
            "snapshot_version": bound.snapshot_version,
            "capability": bound.capability,
            "operation": bound.operation,
            "risk": bound.risk,
            "input_digest": bound.input_digest,
            "issued_at": decision.issued_at,
            "expires_at": decision.expires_at,
        }
        row = await self.store.register_decision(params)
        created = bool(row["created"])
        if not created:
            try:
                domain.why_not_registered(row, decision.digest, params["id_count"])
            except ParleyError as exc:
                self.metrics.decisions.labels("capability", exc.code.lower()).inc()
                raise
        self.metrics.decisions.labels("capability", "registered" if created else "registered_again").inc()
        return authz_pb2.RegisterDecisionResponse(
            decision_id=decision.decision_id,
            decision_digest=decision.digest,
            request_digest=bound.digest,
            confirmation_id=decision.confirmation_id or "",
            expires_at=_ts(decision.expires_at),
            created=created,
        )

    @strict
    async def IssueConfirmation(
        self, request: authz_pb2.IssueConfirmationRequest
    ) -> authz_pb2.IssueConfirmationResponse:
        agent_id = domain.agent_uuid(request.agent_id, contract=True)
        grant = authz_pb2.ConfirmationGrant(
            version=contracts.VERSION,
            agent_id=str(agent_id),
            confirmation_id=domain.opaque_id(request.confirmation_id, "confirmation_id", contract=True),
            decision_id=domain.opaque_id(request.decision_id, "decision_id", contract=True),
            decision_digest=domain.hex_digest(request.decision_digest, "decision_digest"),
            grant_id=uuid.uuid4().hex,
            issued_at=_ts(_now_ms()),
        )
        grant.digest = canonical.grant_digest(grant)
        params = {
            "agent_id": agent_id,
            "confirmation_id": grant.confirmation_id,
            "decision_id": grant.decision_id,
            "decision_digest": grant.decision_digest,
            "grant_id": grant.grant_id,
            "grant_digest": grant.digest,
            "issued_by": domain.opaque_id(request.issued_by, "issued_by", contract=True),
            "issued_at": grant.issued_at.ToDatetime(tzinfo=UTC),
        }
        if await self.store.issue_confirmation(params):
            self.metrics.decisions.labels("capability", "confirmation_issued").inc()
            return authz_pb2.IssueConfirmationResponse(grant=grant)
        seen = await self.store.confirmation_seen(agent_id, grant.confirmation_id)
        error = domain.why_not_issued(seen, grant.decision_id, grant.decision_digest)
        self.metrics.decisions.labels("capability", error.code.lower()).inc()
        raise error

    @strict
    async def Authorize(self, request: authz_pb2.AuthorizeRequest) -> authz_pb2.AuthorizeResponse:
        if not request.HasField("request"):
            raise InvalidContract("request is required")
        bound = contracts.capability_request(request.request)
        decision_id = domain.opaque_id(request.decision_id, "decision_id", contract=True)
        decision_digest = domain.hex_digest(request.decision_digest, "decision_digest")
        grant_digest = (
            contracts.confirmation_grant(
                request.grant,
                agent_id=bound.agent_id,
                decision_id=decision_id,
                decision_digest=decision_digest,
            )
            if request.HasField("grant")
            else None
        )
        authorization_id = canonical.authorization_id(
            str(bound.agent_id), bound.digest, decision_digest, grant_digest
        )
        row = await self.store.authorize(
            {
                "agent_id": bound.agent_id,
                "decision_id": decision_id,
                "decision_digest": decision_digest,
                "request_digest": bound.digest,
                "grant_digest": grant_digest,
                "authorization_id": authorization_id,
            }
        )
        if row["authorization_id"] is None:
            refusal = domain.why_not_authorized(
                row, request_digest=bound.digest, decision_digest=decision_digest, grant_digest=grant_digest
            )
            if refusal.burned:
                self.metrics.burned.labels(refusal.burned).inc()
                log.info("capability decision burned", agent_id=str(bound.agent_id), reason=refusal.burned)
            self.metrics.decisions.labels("capability", refusal.error.code.lower()).inc()
            raise refusal.error
        self.metrics.decisions.labels("capability", "authorized").inc()
        return authz_pb2.AuthorizeResponse(
            authorization=authz_pb2.CapabilityAuthorization(
                id=row["authorization_id"],
                agent_id=str(bound.agent_id),
                request_digest=row["authorized_request_digest"],
                decision_id=row["authorized_decision_id"],
                decision_digest=row["authorized_decision_digest"],
                grant_digest=row["authorized_grant_digest"] or "",
                account_id=row["account_id"],
                snapshot_version=row["snapshot_version"],
                capability=row["capability"],
                operation=row["operation"],
                risk=authz_pb2.RiskLevel.Value("RISK_LEVEL_" + row["risk"]),
                input_digest=row["input_digest"],
                authorized_at=_ts(row["authorized_at"]),
            )
        )

    @strict
    async def RecordReceipt(self, request: authz_pb2.RecordReceiptRequest) -> authz_pb2.RecordReceiptResponse:
        agent_id = domain.agent_uuid(request.agent_id, contract=True)
        if not request.HasField("receipt"):
            raise InvalidContract("receipt is required")
        receipt = contracts.effect_receipt(request.receipt)
        row = await self.store.record_receipt(
            {"agent_id": agent_id, "receipt_digest": receipt["digest"], **receipt}
        )
        if row["recorded_at"] is not None:
            self.metrics.decisions.labels("capability", "receipt_recorded").inc()
            return authz_pb2.RecordReceiptResponse(
                receipt_digest=receipt["digest"], created=True, recorded_at=_ts(row["recorded_at"])
            )
        domain.why_not_recorded(row, receipt, receipt["digest"])
        return authz_pb2.RecordReceiptResponse(
            receipt_digest=receipt["digest"], created=False, recorded_at=_ts(row["existing_recorded_at"])
        )

    # ----- 3. interaction leases -------------------------------------------------------

    def _holder(self, request: Any) -> tuple[uuid.UUID, str, str, str, int]:
        return (
            domain.agent_uuid(request.agent_id),
            domain.opaque_id(request.lease_id, "lease_id"),
            domain.opaque_id(request.session_id, "session_id"),
            domain.opaque_id(request.owner, "owner"),
            domain.generation(request.generation),
        )

    @strict
    async def AcquireLease(self, request: authz_pb2.AcquireLeaseRequest) -> authz_pb2.AcquireLeaseResponse:
        agent_id, lease_id, session_id, owner, generation = self._holder(request)
        kind = domain.resource_kind(request.resource.kind)
        resource_id = domain.opaque_id(request.resource.id, "resource.id")
        params = {
            "agent_id": agent_id,
            "resource_kind": kind,
            "resource_id": resource_id,
            "lease_id": lease_id,
            "session_id": session_id,
            "owner": owner,
            "generation": generation,
            "ttl_ms": domain.ttl_ms(request.ttl_ms, "ttl_ms", maximum=domain.MAX_LEASE_TTL_MS),
        }
        # The holder may release or expire between the refused grant and the look at it: try again then.
        for _ in range(3):
            try:
                row = await self.store.acquire_lease(params)
            except Conflict:
                self.metrics.lease_conflicts.inc()
                self.metrics.decisions.labels("lease", "lease_conflict").inc()
                raise
            if row is not None:
                self.metrics.decisions.labels("lease", "granted").inc()
                return authz_pb2.AcquireLeaseResponse(lease=lease_proto(row), replayed=False)
            holder = await self.store.lease_of_resource(agent_id, kind, resource_id)
            if holder is None or not holder["live"]:
                continue
            if domain.same_holder(holder, lease_id, session_id, owner, generation):
                self.metrics.decisions.labels("lease", "replayed").inc()
                return authz_pb2.AcquireLeaseResponse(lease=lease_proto(holder), replayed=True)
            break
        self.metrics.lease_conflicts.inc()
        self.metrics.decisions.labels("lease", "lease_conflict").inc()
        raise domain.lease_conflict(f"{kind} {resource_id[:100]!r} is held by another lease")

    @strict
    async def RenewLease(self, request: authz_pb2.RenewLeaseRequest) -> authz_pb2.RenewLeaseResponse:
        agent_id, lease_id, session_id, owner, generation = self._holder(request)
        row = await self.store.renew_lease(
            {
                "agent_id": agent_id,
                "lease_id": lease_id,
                "session_id": session_id,
                "owner": owner,
                "generation": generation,
                "ttl_ms": domain.ttl_ms(request.ttl_ms, "ttl_ms", maximum=domain.MAX_LEASE_TTL_MS),
            }
        )
        if row is None:
            raise domain.stale_lease("the lease is not held by this session, owner and generation")
        return authz_pb2.RenewLeaseResponse(lease=lease_proto(row))

    @strict
    async def ReleaseLease(self, request: authz_pb2.ReleaseLeaseRequest) -> authz_pb2.ReleaseLeaseResponse:
        agent_id, lease_id, session_id, owner, generation = self._holder(request)
        row = await self.store.release_lease(
            {
                "agent_id": agent_id,
                "lease_id": lease_id,
                "session_id": session_id,
                "owner": owner,
                "generation": generation,
            }
        )
        if not row["released"] and row["held"]:
            self.metrics.lease_conflicts.inc()
            raise domain.lease_conflict("the lease is held by another session, owner or generation")
        return authz_pb2.ReleaseLeaseResponse(released=row["released"])

    @strict
    async def AssertLeases(self, request: authz_pb2.AssertLeasesRequest) -> authz_pb2.AssertLeasesResponse:
        agent_id = domain.agent_uuid(request.agent_id)
        if not request.HasField("required"):
            raise errors.LEASE_REQUIREMENTS_MISSING(
                "required is missing: list the resources the action needs, or pass an empty list"
            )
        lease_ids = [domain.opaque_id(value, f"lease_ids[{i}]") for i, value in enumerate(request.lease_ids)]
        required = [
            (
                domain.resource_kind(r.kind, f"required.resources[{i}].kind"),
                domain.opaque_id(r.id, f"required.resources[{i}].id"),
            )
            for i, r in enumerate(request.required.resources)
        ]
        rows = await self.store.leases_by_id(agent_id, lease_ids) if lease_ids else []
        held = domain.check_leases(
            rows,
            lease_ids=lease_ids,
            session_id=domain.opaque_id(request.session_id, "session_id"),
            owner=domain.opaque_id(request.owner, "owner"),
            generation=domain.generation(request.generation),
            required=required,
        )
        return authz_pb2.AssertLeasesResponse(leases=[lease_proto(r) for r in held])

    @strict
    async def ListLeases(self, request: authz_pb2.ListLeasesRequest) -> authz_pb2.ListLeasesResponse:
        agent_id = domain.agent_uuid(request.agent_id)
        page = page_of(request.page if request.HasField("page") else None)
        rows, page_response = cut(
            page, await self.store.list_leases(agent_id, request.include_expired, page.fetch, page.offset)
        )
        return authz_pb2.ListLeasesResponse(leases=[lease_proto(r) for r in rows], page=page_response)

    # ----- 4. interaction confirmations -----------------------------------------------

    @strict
    async def RegisterInteractionConfirmation(
        self, request: authz_pb2.RegisterInteractionConfirmationRequest
    ) -> authz_pb2.InteractionConfirmationResponse:
        agent_id = domain.agent_uuid(request.agent_id, contract=True)
        confirmation_id = domain.opaque_id(request.confirmation_id, "confirmation_id", contract=True)
        digest = contracts.interaction_action(request.action_json)
        ttl = request.ttl_ms or domain.DEFAULT_INTERACTION_TTL_MS
        row = await self.store.register_interaction(
            {
                "agent_id": agent_id,
                "confirmation_id": confirmation_id,
                "action_digest": digest,
                "ttl_ms": domain.ttl_ms(ttl, "ttl_ms", maximum=domain.MAX_INTERACTION_TTL_MS),
            }
        )
        if row is None:  # a concurrent registration of the same id just committed
            row = await self.store.get_interaction(agent_id, confirmation_id)
            assert row is not None
            row = {**row, "created": False}
        if not row["created"] and (
            row["action_digest"] != digest or row["state"] != "pending" or not row["live"]
        ):
            raise errors.INTERACTION_CONFIRMATION_REUSED(
                "confirmation_id has been used before; interaction confirmations are usable once"
            )
        return authz_pb2.InteractionConfirmationResponse(
            confirmation=interaction_proto(row), created=row["created"]
        )

    @strict
    async def IssueInteractionConfirmation(
        self, request: authz_pb2.IssueInteractionConfirmationRequest
    ) -> authz_pb2.InteractionConfirmationResponse:
        agent_id = domain.agent_uuid(request.agent_id, contract=True)
        confirmation_id = domain.opaque_id(request.confirmation_id, "confirmation_id", contract=True)
        digest = domain.hex_digest(request.action_digest, "action_digest")
        row = await self.store.issue_interaction(
            {
                "agent_id": agent_id,
                "confirmation_id": confirmation_id,
                "action_digest": digest,
                "grant_id": uuid.uuid4().hex,
            }
        )
        if row is None:
            raise domain.why_not_issued_interaction(
                await self.store.get_interaction(agent_id, confirmation_id), digest
            )
        return authz_pb2.InteractionConfirmationResponse(confirmation=interaction_proto(row))

    @strict
    async def ConsumeInteractionConfirmation(
        self, request: authz_pb2.ConsumeInteractionConfirmationRequest
    ) -> authz_pb2.InteractionConfirmationResponse:
        agent_id = domain.agent_uuid(request.agent_id, contract=True)
        confirmation_id = domain.opaque_id(request.confirmation_id, "confirmation_id", contract=True)
        grant_id = domain.opaque_id(request.grant_id, "grant_id", contract=True)
        digest = contracts.interaction_action(request.action_json)
        row = await self.store.consume_interaction(
            {
                "agent_id": agent_id,
                "confirmation_id": confirmation_id,
                "grant_id": grant_id,
                "action_digest": digest,
            }
        )
        if row["state"] is None:
            error = domain.why_not_consumed_interaction(row, grant_id, digest)
            self.metrics.decisions.labels("interaction", error.code.lower()).inc()
            raise error
        self.metrics.decisions.labels("interaction", "consumed").inc()
        return authz_pb2.InteractionConfirmationResponse(confirmation=interaction_proto(row))
