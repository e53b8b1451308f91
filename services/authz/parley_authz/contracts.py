"""Strict validation of the wire contracts, at the edge: protobuf in, checked values and digests out.

A request with a field this service does not know, a wrong version, a bad
digest or a bad timestamp is refused with INVALID_CONTRACT naming the field;
the value itself is never echoed.
"""

from __future__ import annotations

import time
import uuid
from datetime import UTC, datetime

from google.protobuf.message import Message
from google.protobuf.timestamp_pb2 import Timestamp
from google.protobuf.unknown_fields import UnknownFieldSet

from parley.v1 import authz_pb2
from parley_platform import canonical
from parley_platform.canonical import InvalidContract

from . import domain, validate
from .model import VERSION, BoundRequest, CheckedDecision, CheckedReceipt

MAX_TIMESTAMP_SECONDS = 253402300799  # 9999-12-31T23:59:59Z
# How far ahead of this service's clock a caller's timestamp may be.
MAX_CLOCK_SKEW_SECONDS = 5.0


def unknown_field(message: Message, path: str) -> str | None:
    """The path of the first field of ``message`` (or of a message inside it) this service does not know."""
    unknown = UnknownFieldSet(message)
    if len(unknown):
        return f"{path} has a field this service does not know (field number {unknown[0].field_number})"
    for descriptor, value in message.ListFields():
        if descriptor.message_type is None or descriptor.message_type.GetOptions().map_entry:
            continue
        if descriptor.is_repeated:
            for index, item in enumerate(value):
                found = unknown_field(item, f"{path}.{descriptor.name}[{index}]")
                if found:
                    return found
        else:
            found = unknown_field(value, f"{path}.{descriptor.name}")
            if found:
                return found
    return None


def check_known_fields(request: Message) -> None:
    found = unknown_field(request, "request")
    if found:
        raise InvalidContract(found, hint="this service is older than the caller; upgrade it first")


def timestamp(message: Message, name: str, path: str, *, required: bool = True) -> datetime | None:
    """A timestamp field as an aware datetime; whole milliseconds, within years 1970–9999."""
    if not message.HasField(name):
        if required:
            raise InvalidContract(f"{path} is required")
        return None
    ts: Timestamp = getattr(message, name)
    if not 0 <= ts.seconds <= MAX_TIMESTAMP_SECONDS:
        raise InvalidContract(f"{path} must be between 1970 and 9999")
    if ts.nanos % 1_000_000:
        raise InvalidContract(f"{path} must be whole milliseconds")
    return ts.ToDatetime(tzinfo=UTC)


def not_in_future(value: datetime, path: str) -> None:
    if value.timestamp() > time.time() + MAX_CLOCK_SKEW_SECONDS:
        raise InvalidContract(f"{path} is in the future")


def version(value: int, path: str) -> None:
    if value != VERSION:
        raise InvalidContract(
            f"{path} must be {VERSION}: this service speaks version {VERSION} of the contract"
        )


def risk(value: authz_pb2.RiskLevel.ValueType, path: str) -> str:
    if value == authz_pb2.RISK_LEVEL_UNSPECIFIED or value not in authz_pb2.RiskLevel.values():
        raise InvalidContract(f"{path} must be one of R0, R1, R2, R3")
    return canonical.risk_name(value)


def optional_hex(value: str, path: str) -> str | None:
    return validate.hex_digest(value, path) if value else None


# ----- capability requests and decisions --------------------------------------


def capability_request(request: authz_pb2.CapabilityRequest, path: str = "request") -> BoundRequest:
    version(request.version, f"{path}.version")
    agent_id = validate.agent_uuid(request.agent_id, field=f"{path}.agent_id", contract=True)
    account_id = validate.opaque_id(request.account_id, f"{path}.account_id", contract=True)
    snapshot = validate.opaque_id(request.snapshot_version, f"{path}.snapshot_version", contract=True)
    capability = validate.name(request.capability, f"{path}.capability", contract=True)
    operation = validate.name(request.operation, f"{path}.operation", contract=True)
    catalog = risk(request.catalog_risk, f"{path}.catalog_risk")
    bound = risk(request.risk, f"{path}.risk")
    if domain.risk_rank(bound) < domain.risk_rank(catalog):
        raise InvalidContract(f"{path}.risk must not be lower than {path}.catalog_risk")
    input_digest = validate.hex_digest(request.input_digest, f"{path}.input_digest")
    bound_at = timestamp(request, "bound_at", f"{path}.bound_at")
    assert bound_at is not None
    not_in_future(bound_at, f"{path}.bound_at")
    return BoundRequest(
        agent_id,
        account_id,
        snapshot,
        capability,
        operation,
        bound,
        input_digest,
        bound_at,
        canonical.request_digest(request),
    )


OUTCOMES = {
    authz_pb2.POLICY_OUTCOME_ALLOWED: "allowed",
    authz_pb2.POLICY_OUTCOME_CONFIRMATION_REQUIRED: "confirmation_required",
    authz_pb2.POLICY_OUTCOME_DENIED: "denied",
    authz_pb2.POLICY_OUTCOME_UNAVAILABLE: "unavailable",
}


def policy_decision(
    decision: authz_pb2.PolicyDecision, request: BoundRequest, path: str = "decision"
) -> CheckedDecision:
    version(decision.version, f"{path}.version")
    decision_id = validate.opaque_id(decision.decision_id, f"{path}.decision_id", contract=True)
    request_digest = validate.hex_digest(decision.request_digest, f"{path}.request_digest")
    if request_digest != request.digest:
        raise InvalidContract(f"{path}.request_digest is not the digest of the request")
    outcome = OUTCOMES.get(decision.outcome)
    if outcome is None:
        raise InvalidContract(f"{path}.outcome must be allowed, confirmation_required, denied or unavailable")
    confirmation_id: str | None = None
    if outcome == "confirmation_required":
        confirmation_id = validate.opaque_id(
            decision.confirmation_id, f"{path}.confirmation_id", contract=True
        )
    elif decision.confirmation_id:
        raise InvalidContract(f"{path}.confirmation_id is only for confirmation_required")
    denial_code = ""
    if outcome == "denied":
        if decision.denial_code not in authz_pb2.PolicyDenialCode.values() or not decision.denial_code:
            raise InvalidContract(f"{path}.denial_code must be one of the policy denial codes")
        denial_code = (
            str(authz_pb2.PolicyDenialCode.Name(decision.denial_code))
            .removeprefix("POLICY_DENIAL_CODE_")
            .lower()
        )
    elif decision.denial_code:
        raise InvalidContract(f"{path}.denial_code is only for denied")
    unavailable_code = ""
    if outcome == "unavailable":
        unavailable_code = validate.code(decision.unavailable_code, f"{path}.unavailable_code")
    elif decision.unavailable_code or decision.retryable:
        field = "unavailable_code" if decision.unavailable_code else "retryable"
        raise InvalidContract(f"{path}.{field} is only for unavailable")
    issued_at = timestamp(decision, "issued_at", f"{path}.issued_at")
    expires_at = timestamp(decision, "expires_at", f"{path}.expires_at")
    assert issued_at is not None
    assert expires_at is not None
    if issued_at >= expires_at:
        raise InvalidContract(f"{path}.expires_at must be after {path}.issued_at")
    if issued_at < request.bound_at:
        raise InvalidContract(f"{path}.issued_at precedes the request's bound_at")
    not_in_future(issued_at, f"{path}.issued_at")
    digest = validate.hex_digest(decision.digest, f"{path}.digest")
    if digest != canonical.decision_digest(decision):
        raise InvalidContract(f"{path}.digest is not the digest of the decision")
    return CheckedDecision(
        decision_id,
        outcome,
        confirmation_id,
        denial_code,
        unavailable_code,
        decision.retryable,
        issued_at,
        expires_at,
        digest,
    )


def confirmation_grant(
    grant: authz_pb2.ConfirmationGrant,
    *,
    agent_id: uuid.UUID,
    decision_id: str,
    decision_digest: str,
    path: str = "grant",
) -> str:
    """The grant's digest, once the grant is well formed and names this decision."""
    version(grant.version, f"{path}.version")
    if validate.agent_uuid(grant.agent_id, field=f"{path}.agent_id", contract=True) != agent_id:
        raise InvalidContract(f"{path}.agent_id is not the request's agent")
    validate.opaque_id(grant.confirmation_id, f"{path}.confirmation_id", contract=True)
    if grant.decision_id != decision_id:
        raise InvalidContract(f"{path}.decision_id is not the decision being authorized")
    if grant.decision_digest != decision_digest:
        raise InvalidContract(f"{path}.decision_digest is not the digest of the decision being authorized")
    validate.opaque_id(grant.grant_id, f"{path}.grant_id", contract=True)
    timestamp(grant, "issued_at", f"{path}.issued_at")
    digest = validate.hex_digest(grant.digest, f"{path}.digest")
    if digest != canonical.grant_digest(grant):
        raise InvalidContract(f"{path}.digest is not the digest of the grant")
    return digest


# ----- receipts ---------------------------------------------------------------

EFFECT_STATUSES = {
    authz_pb2.EFFECT_STATUS_COMMITTED: "committed",
    authz_pb2.EFFECT_STATUS_FAILED: "failed",
}


def effect_receipt(receipt: authz_pb2.EffectReceipt, path: str = "receipt") -> CheckedReceipt:
    version(receipt.version, f"{path}.version")
    status = EFFECT_STATUSES.get(receipt.status)
    if status is None:
        raise InvalidContract(f"{path}.status must be committed or failed")
    error_code: str | None = None
    if status == "failed":
        if not receipt.error_code or receipt.error_code not in authz_pb2.ExecutionErrorCode.values():
            raise InvalidContract(f"{path}.error_code must be one of the execution error codes")
        error_code = (
            str(authz_pb2.ExecutionErrorCode.Name(receipt.error_code))
            .removeprefix("EXECUTION_ERROR_CODE_")
            .lower()
        )
    elif receipt.error_code:
        raise InvalidContract(f"{path}.error_code is only for failed")
    committed_at = timestamp(receipt, "committed_at", f"{path}.committed_at", required=status == "committed")
    if status == "failed" and committed_at is not None:
        raise InvalidContract(f"{path}.committed_at is only for committed")
    observed_at = timestamp(receipt, "observed_at", f"{path}.observed_at")
    assert observed_at is not None
    if committed_at is not None and committed_at > observed_at:
        raise InvalidContract(f"{path}.observed_at precedes {path}.committed_at")
    return CheckedReceipt(
        authorization_id=validate.hex_digest(receipt.authorization_id, f"{path}.authorization_id"),
        request_digest=validate.hex_digest(receipt.request_digest, f"{path}.request_digest"),
        decision_digest=validate.hex_digest(receipt.decision_digest, f"{path}.decision_digest"),
        grant_digest=optional_hex(receipt.grant_digest, f"{path}.grant_digest"),
        account_id=validate.opaque_id(receipt.account_id, f"{path}.account_id", contract=True),
        capability=validate.name(receipt.capability, f"{path}.capability", contract=True),
        operation=validate.name(receipt.operation, f"{path}.operation", contract=True),
        input_digest=validate.hex_digest(receipt.input_digest, f"{path}.input_digest"),
        idempotency_key=validate.hex_digest(receipt.idempotency_key, f"{path}.idempotency_key"),
        status=status,
        error_code=error_code,
        committed_at=committed_at,
        observed_at=observed_at,
        digest=canonical.receipt_digest(receipt),
    )


# ----- interaction actions ------------------------------------------------------


def interaction_action(action_json: str, path: str = "action_json") -> str:
    """The digest of an interaction action given as a JSON object."""
    if not action_json:
        raise InvalidContract(f"{path} is required")
    action = canonical.parse_json(action_json, what=path)
    if not isinstance(action, dict):
        raise InvalidContract(f"{path} must be a JSON object")
    return canonical.interaction_action_digest(action)
