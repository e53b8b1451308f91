"""The pure rules of authz: contract validation at the edge, and what a refused state change means."""

from __future__ import annotations

import time
import uuid
from datetime import UTC, datetime
from typing import Any

import pytest
from google.protobuf.timestamp_pb2 import Timestamp

from parley.v1 import authz_pb2
from parley_authz import contracts, domain
from parley_authz.model import AuthorizeOutcome, Lease, SeenDecision, ToolCall
from parley_platform import canonical
from parley_platform.canonical import InvalidContract
from parley_platform.errors import Conflict, FailedPrecondition, NotFound, PermissionDenied, Unavailable

AGENT = str(uuid.uuid4())
SECRET = "sk-live-DO-NOT-ECHO-0123456789"


def ts(millis: int) -> Timestamp:
    return Timestamp(seconds=millis // 1000, nanos=(millis % 1000) * 1_000_000)


def now_ms() -> int:
    return int(time.time() * 1000)


def request(**overrides: Any) -> authz_pb2.CapabilityRequest:
    fields: dict[str, Any] = {
        "version": 1,
        "agent_id": AGENT,
        "account_id": "acct-1",
        "snapshot_version": "v1",
        "capability": "mail.send",
        "operation": "create",
        "catalog_risk": authz_pb2.RISK_LEVEL_R1,
        "risk": authz_pb2.RISK_LEVEL_R1,
        "input_digest": "a" * 64,
        "bound_at": ts(now_ms() - 1000),
    }
    fields.update(overrides)
    return authz_pb2.CapabilityRequest(**fields)


def decision_for(bound: contracts.BoundRequest, **overrides: Any) -> authz_pb2.PolicyDecision:
    issued = int(bound.bound_at.timestamp() * 1000) + 1
    fields: dict[str, Any] = {
        "version": 1,
        "decision_id": "d-1",
        "request_digest": bound.digest,
        "outcome": authz_pb2.POLICY_OUTCOME_ALLOWED,
        "issued_at": ts(issued),
        "expires_at": ts(issued + 60_000),
    }
    fields.update(overrides)
    decision = authz_pb2.PolicyDecision(**fields)
    if "digest" not in overrides:
        decision.digest = canonical.decision_digest(decision)
    return decision


# ----- contracts ---------------------------------------------------------------------------


def with_unknown_field(message: Any, number: int = 99) -> bytes:
    """The message's bytes plus a varint field it does not declare."""
    return bytes(message.SerializeToString()) + bytes([(number << 3) & 0x7F | 0x80, number >> 4, 0x01])


def test_unknown_field_is_named_by_path_and_number() -> None:
    inner = authz_pb2.CapabilityRequest.FromString(with_unknown_field(request()))
    outer = authz_pb2.AuthorizeRequest(decision_id="d-1")
    outer.request.CopyFrom(inner)
    with pytest.raises(InvalidContract) as caught:
        contracts.check_known_fields(outer)
    assert caught.value.code == "INVALID_CONTRACT"
    assert "request.request has a field this service does not know (field number 99)" in caught.value.message
    top = authz_pb2.DecideRequest.FromString(
        with_unknown_field(authz_pb2.DecideRequest(tool_call_id="x"), 42)
    )
    with pytest.raises(InvalidContract, match=r"request has a field .* \(field number 42\)"):
        contracts.check_known_fields(top)
    contracts.check_known_fields(authz_pb2.AuthorizeRequest(request=request()))


def test_a_valid_request_binds_to_its_digest() -> None:
    message = request()
    bound = contracts.capability_request(message)
    assert bound.digest == canonical.request_digest(message)
    assert bound.risk == "R1"


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"version": 2}, "request.version must be 1"),
        ({"agent_id": SECRET}, "request.agent_id must be a UUID"),
        ({"account_id": ""}, "request.account_id is required"),
        ({"account_id": "x" * 201}, "request.account_id must be 1 to 200"),
        ({"snapshot_version": "v\n1"}, "request.snapshot_version must be 1 to 200"),
        ({"capability": SECRET + " !"}, "request.capability must start with a letter"),
        ({"catalog_risk": 0}, "request.catalog_risk must be one of"),
        ({"risk": authz_pb2.RISK_LEVEL_R0}, "request.risk must not be lower than request.catalog_risk"),
        ({"input_digest": SECRET}, "request.input_digest must be a SHA-256 digest"),
        ({"input_digest": "A" * 64}, "request.input_digest must be a SHA-256 digest"),
        ({"bound_at": Timestamp(seconds=1, nanos=1)}, "request.bound_at must be whole milliseconds"),
        ({"bound_at": ts(now_ms() + 3_600_000)}, "request.bound_at is in the future"),
    ],
)
def test_bad_requests_name_the_field_and_never_echo(overrides: dict[str, Any], field: str) -> None:
    with pytest.raises(InvalidContract) as caught:
        contracts.capability_request(request(**overrides))
    assert caught.value.code == "INVALID_CONTRACT"
    assert field in caught.value.message
    assert SECRET not in str(caught.value)


def test_missing_bound_at_is_required() -> None:
    bare = request()
    bare.ClearField("bound_at")
    with pytest.raises(InvalidContract, match=r"request\.bound_at is required"):
        contracts.capability_request(bare)


def test_a_valid_decision_checks_out() -> None:
    bound = contracts.capability_request(request())
    checked = contracts.policy_decision(decision_for(bound), bound)
    assert checked.outcome == "allowed"
    assert checked.confirmation_id is None
    confirming = contracts.policy_decision(
        decision_for(bound, outcome=authz_pb2.POLICY_OUTCOME_CONFIRMATION_REQUIRED, confirmation_id="c-1"),
        bound,
    )
    assert confirming.confirmation_id == "c-1"


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"version": 0}, "decision.version must be 1"),
        ({"request_digest": "b" * 64}, "decision.request_digest is not the digest of the request"),
        ({"digest": "c" * 64}, "decision.digest is not the digest of the decision"),
        ({"digest": SECRET}, "decision.digest must be a SHA-256 digest"),
        ({"outcome": 0}, "decision.outcome must be"),
        ({"confirmation_id": "c-1"}, "decision.confirmation_id is only for confirmation_required"),
        ({"outcome": authz_pb2.POLICY_OUTCOME_CONFIRMATION_REQUIRED}, "decision.confirmation_id is required"),
        ({"outcome": authz_pb2.POLICY_OUTCOME_DENIED}, "decision.denial_code must be one of"),
        ({"denial_code": 1}, "decision.denial_code is only for denied"),
        ({"retryable": True}, "decision.retryable is only for unavailable"),
        (
            {"outcome": authz_pb2.POLICY_OUTCOME_UNAVAILABLE, "unavailable_code": SECRET},
            "decision.unavailable_code must be a lower_snake_case code",
        ),
    ],
)
def test_bad_decisions_name_the_field(overrides: dict[str, Any], field: str) -> None:
    bound = contracts.capability_request(request())
    with pytest.raises(InvalidContract) as caught:
        contracts.policy_decision(decision_for(bound, **overrides), bound)
    assert field in caught.value.message
    assert SECRET not in str(caught.value)


def test_decision_timestamps_are_ordered() -> None:
    bound = contracts.capability_request(request())
    bound_ms = int(bound.bound_at.timestamp() * 1000)
    with pytest.raises(InvalidContract, match=r"decision\.expires_at must be after decision\.issued_at"):
        contracts.policy_decision(decision_for(bound, expires_at=ts(bound_ms + 1)), bound)
    with pytest.raises(InvalidContract, match=r"decision\.issued_at precedes the request's bound_at"):
        contracts.policy_decision(decision_for(bound, issued_at=ts(bound_ms - 1)), bound)


def test_refused_outcomes_become_their_errors() -> None:
    denied = domain.refused_outcome("denied", "risk_policy_denied", "", False)
    assert isinstance(denied, PermissionDenied)
    assert denied.code == "CAPABILITY_POLICY_DENIED"
    assert "risk_policy_denied" in denied.message
    unavailable = domain.refused_outcome("unavailable", "", "policy_engine_down", True)
    assert isinstance(unavailable, Unavailable)
    assert unavailable.code == "CAPABILITY_UNAVAILABLE"
    assert unavailable.retryable


def test_risk_is_raised_never_lowered() -> None:
    assert domain.bound_risk("R1", "R3") == "R3"
    assert domain.bound_risk("R2", "R0") == "R2"
    assert domain.bound_risk("R2", None) == "R2"


def test_receipt_chronology_and_codes() -> None:
    base = {
        "version": 1,
        "authorization_id": "1" * 64,
        "request_digest": "2" * 64,
        "decision_digest": "3" * 64,
        "account_id": "acct-1",
        "capability": "mail.send",
        "operation": "create",
        "input_digest": "4" * 64,
        "idempotency_key": "2" * 64,
    }
    committed = authz_pb2.EffectReceipt(
        **base, status=authz_pb2.EFFECT_STATUS_COMMITTED, committed_at=ts(2000), observed_at=ts(3000)
    )
    checked = contracts.effect_receipt(committed)
    assert checked.status == "committed"
    assert checked.error_code is None
    assert checked.grant_digest is None
    backwards = authz_pb2.EffectReceipt(
        **base, status=authz_pb2.EFFECT_STATUS_COMMITTED, committed_at=ts(3000), observed_at=ts(2000)
    )
    with pytest.raises(InvalidContract, match=r"receipt\.observed_at precedes receipt\.committed_at"):
        contracts.effect_receipt(backwards)
    failed = authz_pb2.EffectReceipt(
        **base,
        status=authz_pb2.EFFECT_STATUS_FAILED,
        error_code=authz_pb2.EXECUTION_ERROR_CODE_RATE_LIMITED,
        observed_at=ts(3000),
    )
    assert contracts.effect_receipt(failed).error_code == "rate_limited"
    with pytest.raises(InvalidContract, match=r"receipt\.error_code must be one of"):
        contracts.effect_receipt(
            authz_pb2.EffectReceipt(**base, status=authz_pb2.EFFECT_STATUS_FAILED, observed_at=ts(3000))
        )
    with pytest.raises(InvalidContract, match=r"receipt\.committed_at is required"):
        contracts.effect_receipt(
            authz_pb2.EffectReceipt(**base, status=authz_pb2.EFFECT_STATUS_COMMITTED, observed_at=ts(3000))
        )


def test_interaction_action_must_be_an_object() -> None:
    with pytest.raises(InvalidContract, match="action_json must be a JSON object"):
        contracts.interaction_action("[1, 2]")
    with pytest.raises(InvalidContract, match="action_json is required"):
        contracts.interaction_action("")
    assert contracts.interaction_action('{"kind": "click", "grant_id": "g"}') == contracts.interaction_action(
        '{"kind":"click"}'
    )


# ----- tool-call decisions --------------------------------------------------------------------


def call_row(**fields: Any) -> ToolCall:
    row: dict[str, Any] = {
        "agent_id": uuid.UUID(AGENT),
        "id": "call-1",
        "conversation_id": "room-1",
        "message_id": "msg-1",
        "call_index": 0,
        "tool": "SEND_EMAIL",
        "args_digest": "a" * 64,
        "summary": "",
        "proposed_at": datetime.now(UTC),
        "expires_at": None,
        "on_expiry": "deny",
        "status": "pending",
        "decision": None,
        "reason": None,
        "decided_by": None,
        "decided_at": None,
        "claim_token": None,
        "claimed_at": None,
        "outcome": None,
        "result": None,
        "settled_by": None,
        "settled_at": None,
        "expired": False,
    }
    row.update(fields)
    return ToolCall(**row)


def test_decide_answers_for_a_record_that_did_not_change() -> None:
    with pytest.raises(NotFound) as missing:
        domain.why_not_decided(None, "approve")
    assert missing.value.code == "ACTION_NOT_FOUND"
    claimed = call_row(status="claimed", decision="approve", decided_by="op")
    assert domain.why_not_decided(claimed, "approve").result == "in_flight"
    with pytest.raises(Conflict) as conflicting:
        domain.why_not_decided(claimed, "deny")
    assert conflicting.value.code == "ACTION_ALREADY_DECIDED"
    denied = call_row(status="settled", decision="deny", decided_by="op", outcome="denied")
    assert domain.why_not_decided(denied, "deny").result == "recorded"
    expired = call_row(status="settled", decision="deny", decided_by=domain.EXPIRY, outcome="expired")
    with pytest.raises(Conflict, match="expired"):
        domain.why_not_decided(expired, "deny")
    with pytest.raises(Conflict, match="expired"):
        domain.why_not_decided(call_row(expired=True), "approve")


def test_settle_answers() -> None:
    token = uuid.uuid4()
    with pytest.raises(FailedPrecondition) as unclaimed:
        domain.why_not_settled(call_row(), token, "success", "")
    assert unclaimed.value.code == "ACTION_NOT_CLAIMED"
    claimed = call_row(status="claimed", decision="approve", claim_token=uuid.uuid4())
    with pytest.raises(Conflict) as stale:
        domain.why_not_settled(claimed, token, "success", "")
    assert stale.value.code == "STALE_CLAIM_TOKEN"
    settled = call_row(
        status="settled", decision="approve", claim_token=token, outcome="success", result="42"
    )
    assert domain.why_not_settled(settled, token, "success", "42") is settled
    with pytest.raises(FailedPrecondition) as again:
        domain.why_not_settled(settled, token, "failure", "42")
    assert again.value.code == "ACTION_ALREADY_SETTLED"


def test_conversation_continues_only_when_every_call_is_settled() -> None:
    rows = [call_row(status="settled"), call_row(status="claimed")]
    assert domain.conversation_status(rows) == (True, False)
    assert domain.conversation_status([*rows, call_row()]) == (False, False)
    assert domain.conversation_status([call_row(status="settled")] * 2) == (True, True)


# ----- leases -----------------------------------------------------------------------------------


def lease(lease_id: str, kind: str, live: bool = True, owner: str = "a") -> Lease:
    now = datetime.now(UTC)
    return Lease(
        agent_id=uuid.UUID(AGENT),
        lease_id=lease_id,
        resource_kind=kind,
        resource_id="main",
        session_id="s",
        owner=owner,
        generation=1,
        fencing_token=1,
        acquired_at=now,
        renewed_at=now,
        expires_at=now,
        live=live,
    )


def test_assert_leases_requires_every_resource_covered_by_a_live_matching_lease() -> None:
    rows = [lease("l1", "pointer"), lease("l2", "keyboard")]
    held = domain.check_leases(
        rows,
        lease_ids=["l1", "l2"],
        session_id="s",
        owner="a",
        generation=1,
        required=[("pointer", "main"), ("keyboard", "main")],
    )
    assert [r.lease_id for r in held] == ["l1", "l2"]
    assert domain.check_leases([], lease_ids=[], session_id="s", owner="a", generation=1, required=[]) == []
    with pytest.raises(FailedPrecondition, match=r"required.resources\[1\] \(clipboard\)"):
        domain.check_leases(
            rows,
            lease_ids=["l1"],
            session_id="s",
            owner="a",
            generation=1,
            required=[("pointer", "main"), ("clipboard", "main")],
        )
    with pytest.raises(FailedPrecondition, match=r"lease_ids\[0\] is not held"):
        domain.check_leases(
            [lease("l1", "pointer", live=False)],
            lease_ids=["l1"],
            session_id="s",
            owner="a",
            generation=1,
            required=[],
        )
    with pytest.raises(FailedPrecondition, match="held by another") as other:
        domain.check_leases(
            [lease("l1", "pointer", owner="b")],
            lease_ids=["l1"],
            session_id="s",
            owner="a",
            generation=1,
            required=[],
        )
    assert other.value.code == "STALE_LEASE"


@pytest.mark.parametrize(
    ("live", "current", "says"),
    [
        (False, True, "expired"),
        (True, False, "snapshot of the decision is no longer current"),
        (False, False, "expired"),
    ],
)
def test_a_decision_seen_dead_but_deleted_by_another_statement_is_refused_as_dead(
    live: bool, current: bool, says: str
) -> None:
    """Authorize's snapshot saw the decision dead (expired, or its snapshot replaced), but a
    concurrent Authorize or the sweeper deleted it first: refused as dead authority, not as waiting
    for a confirmation, and not counted as burned by this call."""
    seen = SeenDecision(
        request_digest="r" * 64,
        decision_digest="d" * 64,
        confirmation_id="c-1",
        live=live,
        current=current,
        confirmation_state="pending",
        grant_digest=None,
    )
    outcome = AuthorizeOutcome(authorization=None, deleted=False, deleted_current=None, seen=seen, known=True)
    refusal = domain.why_not_authorized(
        outcome, request_digest="r" * 64, decision_digest="d" * 64, grant_digest=None
    )
    assert refusal.error.code == "STALE_CAPABILITY_AUTHORIZATION"
    assert says in refusal.error.message
    assert refusal.burned is None
