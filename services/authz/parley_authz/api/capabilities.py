"""One-shot capability authorization: account snapshots, bound requests, policy decisions,
confirmations, the authorization itself and its receipt."""

from __future__ import annotations

import dataclasses
import uuid

from parley.v1 import authz_pb2
from parley_platform import canonical
from parley_platform.canonical import InvalidContract
from parley_platform.convert import timestamp
from parley_platform.errors import ParleyError
from parley_platform.logging import get_logger

from .. import contracts, domain, errors, validate
from ..model import VERSION, AuthorizationAttempt, ConfirmationGrant
from .edge import Handlers, now_ms, strict

log = get_logger(__name__)


class Capabilities(Handlers):
    def count(self, outcome: str) -> None:
        self.metrics.decisions.labels("capability", outcome).inc()

    @strict
    async def PutAccountSnapshot(
        self, request: authz_pb2.PutAccountSnapshotRequest
    ) -> authz_pb2.PutAccountSnapshotResponse:
        agent_id = validate.agent_uuid(request.agent_id, contract=True)
        account_id = validate.opaque_id(request.account_id, "account_id", contract=True)
        version = validate.opaque_id(request.snapshot_version, "snapshot_version", contract=True)
        put = await self.store.put_account_snapshot(agent_id, account_id, version)
        if not put.created and not put.current:
            raise errors.SNAPSHOT_VERSION_RETIRED(
                "snapshot_version was current before and has been replaced or revoked"
            )
        return authz_pb2.PutAccountSnapshotResponse(created=put.created)

    @strict
    async def RevokeAccountSnapshot(
        self, request: authz_pb2.RevokeAccountSnapshotRequest
    ) -> authz_pb2.RevokeAccountSnapshotResponse:
        agent_id = validate.agent_uuid(request.agent_id, contract=True)
        account_id = validate.opaque_id(request.account_id, "account_id", contract=True)
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
            version=VERSION,
            agent_id=str(validate.agent_uuid(request.agent_id, contract=True)),
            account_id=validate.opaque_id(request.account_id, "account_id", contract=True),
            snapshot_version=validate.opaque_id(request.snapshot_version, "snapshot_version", contract=True),
            capability=validate.name(request.capability, "capability", contract=True),
            operation=validate.name(request.operation, "operation", contract=True),
            catalog_risk=request.catalog_risk,
            risk=authz_pb2.RiskLevel.Value("RISK_LEVEL_" + domain.bound_risk(catalog, contextual)),
            input_digest=validate.hex_digest(request.input_digest, "input_digest"),
            bound_at=timestamp(now_ms()),
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
            self.count(error.code.lower())
            raise error
        registration = await self.store.register_decision(bound, decision)
        if not registration.created:
            try:
                domain.why_not_registered(registration, decision.digest, decision.id_count)
            except ParleyError as exc:
                self.count(exc.code.lower())
                raise
        self.count("registered" if registration.created else "registered_again")
        return authz_pb2.RegisterDecisionResponse(
            decision_id=decision.decision_id,
            decision_digest=decision.digest,
            request_digest=bound.digest,
            confirmation_id=decision.confirmation_id or "",
            expires_at=timestamp(decision.expires_at),
            created=registration.created,
        )

    @strict
    async def IssueConfirmation(
        self, request: authz_pb2.IssueConfirmationRequest
    ) -> authz_pb2.IssueConfirmationResponse:
        unsigned = ConfirmationGrant(
            agent_id=validate.agent_uuid(request.agent_id, contract=True),
            confirmation_id=validate.opaque_id(request.confirmation_id, "confirmation_id", contract=True),
            decision_id=validate.opaque_id(request.decision_id, "decision_id", contract=True),
            decision_digest=validate.hex_digest(request.decision_digest, "decision_digest"),
            grant_id=uuid.uuid4().hex,
            issued_at=now_ms(),
        )
        grant = dataclasses.replace(unsigned, digest=canonical.grant_digest(unsigned.to_proto()))
        issued_by = validate.opaque_id(request.issued_by, "issued_by", contract=True)
        if await self.store.issue_confirmation(grant, issued_by):
            self.count("confirmation_issued")
            return authz_pb2.IssueConfirmationResponse(grant=grant.to_proto())
        seen = await self.store.confirmation_seen(grant.agent_id, grant.confirmation_id)
        error = domain.why_not_issued(seen, grant.decision_id, grant.decision_digest)
        self.count(error.code.lower())
        raise error

    @strict
    async def Authorize(self, request: authz_pb2.AuthorizeRequest) -> authz_pb2.AuthorizeResponse:
        if not request.HasField("request"):
            raise InvalidContract("request is required")
        bound = contracts.capability_request(request.request)
        decision_id = validate.opaque_id(request.decision_id, "decision_id", contract=True)
        decision_digest = validate.hex_digest(request.decision_digest, "decision_digest")
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
        attempt = AuthorizationAttempt(
            agent_id=bound.agent_id,
            decision_id=decision_id,
            decision_digest=decision_digest,
            request_digest=bound.digest,
            grant_digest=grant_digest,
            authorization_id=canonical.authorization_id(
                str(bound.agent_id), bound.digest, decision_digest, grant_digest
            ),
        )
        outcome = await self.store.authorize(attempt)
        if outcome.authorization is None:
            refusal = domain.why_not_authorized(
                outcome,
                request_digest=bound.digest,
                decision_digest=decision_digest,
                grant_digest=grant_digest,
            )
            if refusal.burned:
                self.metrics.burned.labels(refusal.burned).inc()
                log.info("capability decision burned", agent_id=str(bound.agent_id), reason=refusal.burned)
            self.count(refusal.error.code.lower())
            raise refusal.error
        self.count("authorized")
        return authz_pb2.AuthorizeResponse(authorization=outcome.authorization.to_proto())

    @strict
    async def RecordReceipt(self, request: authz_pb2.RecordReceiptRequest) -> authz_pb2.RecordReceiptResponse:
        agent_id = validate.agent_uuid(request.agent_id, contract=True)
        if not request.HasField("receipt"):
            raise InvalidContract("receipt is required")
        receipt = contracts.effect_receipt(request.receipt)
        outcome = await self.store.record_receipt(agent_id, receipt)
        if outcome.recorded_at is not None:
            self.count("receipt_recorded")
            return authz_pb2.RecordReceiptResponse(
                receipt_digest=receipt.digest, created=True, recorded_at=timestamp(outcome.recorded_at)
            )
        existing = domain.why_not_recorded(outcome, receipt)
        return authz_pb2.RecordReceiptResponse(
            receipt_digest=receipt.digest, created=False, recorded_at=timestamp(existing.recorded_at)
        )
