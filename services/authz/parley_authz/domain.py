"""Pure rules of the authz service: what a refused state change means.

Every state change is one SQL statement naming the state it expects; when it
changes nothing, the record as it is now (or as the statement saw it) is passed
to a ``why_*`` function here, which returns the answer or the error the caller
gets. Errors never echo ids, digests or account data: they can be sensitive.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Literal

from parley_platform.canonical import InvalidContract
from parley_platform.errors import ParleyError

from . import errors
from .model import (
    AuthorizeOutcome,
    CheckedReceipt,
    ConfirmationSeen,
    ExistingReceipt,
    Holder,
    InteractionConfirmation,
    Lease,
    Proposal,
    ReceiptOutcome,
    Registration,
    SeenInteraction,
    SettleOutcome,
    ToolCall,
    ToolDecision,
)

MAX_RESULT_BYTES = 65536
MAX_LEASE_TTL_MS = 60_000
MAX_INTERACTION_TTL_MS = 3_600_000
DEFAULT_INTERACTION_TTL_MS = 300_000

EXPIRY = "expiry"  # decided_by / settled_by when the expiry default decided


def risk_rank(value: str) -> int:
    return int(value.removeprefix("R"))


def bound_risk(catalog: str, contextual: str | None) -> str:
    """The risk of a bound request: the contextual risk may raise the catalog's, never lower it."""
    if contextual is None or risk_rank(contextual) < risk_rank(catalog):
        return catalog
    return contextual


# ----- 1. tool-call decisions -------------------------------------------------


def action_not_found() -> ParleyError:
    return errors.ACTION_NOT_FOUND("no tool call with that id for this agent")


def check_same_proposal(call: ToolCall, proposal: Proposal) -> None:
    """PutPending of an id already recorded: only the same proposal again is a replay."""
    same = (
        ("conversation_id", call.conversation_id == proposal.conversation_id),
        ("message_id", call.message_id == proposal.message_id),
        ("call_index", call.call_index == proposal.call_index),
        ("tool", call.tool == proposal.tool),
        ("args_digest", call.args_digest == proposal.args_digest),
    )
    for field, equal in same:
        if not equal:
            raise errors.TOOL_CALL_ID_REUSED(
                f"tool_call_id is already used by another call (its {field} differs)"
            )


@dataclass(frozen=True)
class DecideAnswer:
    """The answer to a Decide that did not take the claim itself."""

    result: Literal["in_flight", "recorded"]  # the same approval not settled yet; the same decision, settled
    call: ToolCall


def why_not_decided(call: ToolCall | None, decision: ToolDecision) -> DecideAnswer:
    """Decide changed nothing: the same decision is idempotent, anything else is refused."""
    if call is None:
        raise action_not_found()
    expired = "the tool call expired before a decision; its expiry default applies"
    if call.status == "pending":
        if call.expired:
            raise errors.ACTION_ALREADY_DECIDED(expired)
        # Not expired and still pending cannot follow a failed claim; let the caller retry.
        raise errors.DECIDE_RACE("the tool call changed while deciding")
    if call.decided_by == EXPIRY:
        raise errors.ACTION_ALREADY_DECIDED(expired)
    if call.decision != decision:
        raise errors.ACTION_ALREADY_DECIDED(f"the tool call was already decided: {call.decision}")
    return DecideAnswer("in_flight" if call.status == "claimed" else "recorded", call)


def why_not_settled(
    call: ToolCall | None, claim_token: uuid.UUID, outcome: SettleOutcome, result: str
) -> ToolCall:
    """Settle changed nothing: an identical repeat returns the record, anything else is refused."""
    if call is None:
        raise action_not_found()
    if call.status == "pending":
        raise errors.ACTION_NOT_CLAIMED("the tool call has not been approved, so there is no claim to settle")
    if call.status == "claimed":
        raise errors.STALE_CLAIM_TOKEN("the claim token does not match the claim on this tool call")
    if call.claim_token == claim_token and call.outcome == outcome and (call.result or "") == result:
        return call
    raise errors.ACTION_ALREADY_SETTLED(f"the tool call is already settled ({call.outcome})")


def conversation_status(calls: list[ToolCall]) -> tuple[bool, bool]:
    """(all decided, all settled) of one assistant message's tool calls; an expired one counts as decided."""
    decided = all(c.status != "pending" or c.expired for c in calls)
    settled = all(c.status == "settled" for c in calls)
    return decided, settled


# ----- 2. capability authorization -------------------------------------------


def refused_outcome(outcome: str, denial_code: str, unavailable_code: str, retryable: bool) -> ParleyError:
    """The error for a decision that grants nothing: RegisterDecision accepts only allowed and
    confirmation_required."""
    if outcome == "denied":
        return errors.CAPABILITY_POLICY_DENIED(f"the policy denied the capability: {denial_code}")
    error = errors.CAPABILITY_UNAVAILABLE(f"the policy could not decide: {unavailable_code}")
    error.retryable = retryable  # type: ignore[misc]  # the policy says whether asking again may help
    return error


def why_not_registered(registration: Registration, decision_digest: str, id_count: int) -> bool:
    """RegisterDecision recorded nothing. Returns True for a retry of the same registration."""
    if not registration.current:
        raise errors.STALE_CAPABILITY_AUTHORIZATION("the account snapshot of the request is not current")
    if not registration.live:
        raise errors.STALE_CAPABILITY_AUTHORIZATION("the decision has already expired")
    if registration.registered_digest == decision_digest:
        return True
    spent = set(registration.spent or [])
    reused = [kind for kind in ("decision", "confirmation") if kind not in spent]
    which = "decision_id" if "decision" in reused or id_count == 1 else "confirmation_id"
    raise errors.CAPABILITY_DECISION_REUSED(
        f"{which} has been used before; decision and confirmation ids are usable once, ever"
    )


def why_not_issued(seen: ConfirmationSeen | None, decision_id: str, decision_digest: str) -> ParleyError:
    stale = errors.STALE_CAPABILITY_CONFIRMATION
    dead = errors.STALE_CAPABILITY_AUTHORIZATION
    if seen is None:
        return stale("no confirmation with that id is pending for this agent")
    if seen.decision_id != decision_id or (seen.decision_exists and seen.decision_digest != decision_digest):
        return stale("the confirmation belongs to another decision")
    if seen.state != "pending":
        return stale(f"the confirmation is already {seen.state}")
    if not seen.decision_exists:
        return dead("the decision has already been consumed or burned")
    if not seen.live:
        return dead("the decision has expired, and its confirmation with it")
    if not seen.current:
        return dead("the account snapshot of the decision is not current")
    return errors.ISSUE_RACE("the confirmation changed while issuing it")


@dataclass(frozen=True)
class Refusal:
    """Why Authorize granted nothing, and whether it burned the decision."""

    error: ParleyError
    burned: Literal["snapshot", "expired"] | None  # the decision was deleted as dead authority


def why_not_authorized(
    outcome: AuthorizeOutcome, *, request_digest: str, decision_digest: str, grant_digest: str | None
) -> Refusal:
    dead = errors.STALE_CAPABILITY_AUTHORIZATION
    untrusted = errors.UNTRUSTED_CAPABILITY_POLICY_DECISION
    if outcome.deleted:
        if not outcome.deleted_current:
            message = "the account snapshot is no longer current; the decision has been burned"
            return Refusal(dead(message), "snapshot")
        return Refusal(dead("the decision has expired; it has been burned"), "expired")
    seen = outcome.seen
    if seen is None:
        if outcome.known:
            return Refusal(dead("the decision has already been consumed or burned"), None)
        return Refusal(untrusted("no decision with that id was registered for this agent"), None)
    if seen.decision_digest != decision_digest:
        return Refusal(untrusted("decision_digest does not match the registered decision"), None)
    if seen.request_digest != request_digest:
        return Refusal(untrusted("the decision was not issued for this request"), None)
    # Seen dead but deleted by another statement first (a concurrent Authorize, the sweeper).
    if not seen.live:
        return Refusal(dead("the decision has expired"), None)
    if not seen.current:
        return Refusal(dead("the account snapshot of the decision is no longer current"), None)
    if seen.confirmation_id is None:
        if grant_digest is not None:
            return Refusal(
                InvalidContract("grant is given for a decision that requires no confirmation"), None
            )
    elif seen.confirmation_state == "pending":
        message = "the decision requires a confirmation that has not been issued"
        return Refusal(errors.CAPABILITY_CONFIRMATION_REQUIRED(message), None)
    elif grant_digest is None:
        message = "the decision requires a confirmation: pass its grant"
        return Refusal(errors.CAPABILITY_CONFIRMATION_REQUIRED(message), None)
    elif seen.grant_digest != grant_digest or seen.confirmation_state != "issued":
        message = "the grant is not the current grant of this decision"
        return Refusal(errors.STALE_CAPABILITY_CONFIRMATION(message), None)
    # Everything matched in the statement's snapshot: a concurrent caller consumed it first.
    return Refusal(dead("the decision has already been consumed"), None)


def why_not_recorded(outcome: ReceiptOutcome, receipt: CheckedReceipt) -> ExistingReceipt:
    """RecordReceipt recorded nothing. Returns the recorded receipt when this is a repeat of it."""
    authorization = outcome.authorization
    if authorization is None:
        raise errors.AUTHORIZATION_NOT_FOUND("no authorization with that id for this agent")
    bindings = (
        ("request_digest", authorization.request_digest, receipt.request_digest),
        ("decision_digest", authorization.decision_digest, receipt.decision_digest),
        ("grant_digest", authorization.grant_digest, receipt.grant_digest),
        ("account_id", authorization.account_id, receipt.account_id),
        ("capability", authorization.capability, receipt.capability),
        ("operation", authorization.operation, receipt.operation),
        ("input_digest", authorization.input_digest, receipt.input_digest),
    )
    for field, authorized, cited in bindings:
        if (authorized or None) != (cited or None):
            raise InvalidContract(f"receipt.{field} does not match the authorization")
    if receipt.idempotency_key != authorization.request_digest:
        raise InvalidContract("receipt.idempotency_key must equal the authorization's request_digest")
    if outcome.existing is not None:
        if outcome.existing.digest == receipt.digest:
            return outcome.existing
        raise errors.RECEIPT_CONFLICT("a different receipt was already recorded for this authorization")
    first = receipt.committed_at or receipt.observed_at
    if first < authorization.authorized_at:
        field = "committed_at" if receipt.committed_at else "observed_at"
        raise InvalidContract(f"receipt.{field} precedes the authorization")
    if receipt.observed_at > outcome.db_now:
        raise InvalidContract("receipt.observed_at is in the future")
    raise errors.RECEIPT_RACE("the receipt changed while recording it")


# ----- 3. interaction leases ---------------------------------------------------


def held_by(lease: Lease, session_id: str, owner: str, generation: int) -> bool:
    return lease.session_id == session_id and lease.owner == owner and lease.generation == generation


def same_holder(lease: Lease, holder: Holder) -> bool:
    return lease.lease_id == holder.lease_id and held_by(
        lease, holder.session_id, holder.owner, holder.generation
    )


def check_leases(
    leases: list[Lease],
    *,
    lease_ids: list[str],
    session_id: str,
    owner: str,
    generation: int,
    required: list[tuple[str, str]],
) -> list[Lease]:
    """Every named lease is live and held by this session/owner/generation, and every required
    resource is covered by one of them. Liveness is the database's (``live`` of each lease)."""
    by_id = {lease.lease_id: lease for lease in leases}
    for index, lease_id in enumerate(lease_ids):
        lease = by_id.get(lease_id)
        if lease is None or not lease.live:
            raise errors.STALE_LEASE(f"lease_ids[{index}] is not held (released, expired or taken over)")
        if not held_by(lease, session_id, owner, generation):
            raise errors.STALE_LEASE(f"lease_ids[{index}] is held by another session, owner or generation")
    covered = {(by_id[i].resource_kind, by_id[i].resource_id) for i in lease_ids}
    for index, resource in enumerate(required):
        if resource not in covered:
            raise errors.STALE_LEASE(
                f"required.resources[{index}] ({resource[0]}) is not covered by a live lease"
            )
    return [by_id[i] for i in dict.fromkeys(lease_ids)]


# ----- 4. interaction confirmations -------------------------------------------


def check_registered_again(confirmation: InteractionConfirmation, action_digest: str) -> None:
    """A registration of an id already used is a replay only while it is the same pending action."""
    if (
        confirmation.action_digest != action_digest
        or confirmation.state != "pending"
        or not confirmation.live
    ):
        raise errors.INTERACTION_CONFIRMATION_REUSED(
            "confirmation_id has been used before; interaction confirmations are usable once"
        )


def why_not_issued_interaction(
    confirmation: InteractionConfirmation | None, action_digest: str
) -> ParleyError:
    stale = errors.STALE_INTERACTION_CONFIRMATION
    if confirmation is None:
        return stale("no interaction confirmation with that id for this agent")
    if confirmation.state != "pending":
        return stale(f"the interaction confirmation is already {confirmation.state}")
    if not confirmation.live:
        return stale("the interaction confirmation has expired")
    if confirmation.action_digest != action_digest:
        return errors.INTERACTION_CONFIRMATION_MISMATCH(
            "action_digest is not the digest of the registered action"
        )
    return errors.ISSUE_RACE("the confirmation changed while issuing it")


def why_not_consumed_interaction(
    seen: SeenInteraction | None, grant_id: str, action_digest: str
) -> ParleyError:
    stale = errors.STALE_INTERACTION_CONFIRMATION
    mismatch = errors.INTERACTION_CONFIRMATION_MISMATCH
    if seen is None:
        return stale("no interaction confirmation with that id for this agent")
    if seen.state == "consumed":
        return stale("the interaction confirmation has already been used")
    if seen.state == "pending":
        return stale("the interaction confirmation has not been issued")
    if not seen.live:
        return stale("the interaction confirmation has expired")
    if seen.grant_id != grant_id:
        return mismatch("grant_id is not the grant of this confirmation")
    if seen.action_digest != action_digest:
        return mismatch("the action differs from the one that was confirmed")
    return stale("the interaction confirmation has already been used")
