"""Pure rules of the authz service: field validation, and what a refused state change means.

Every state change is one SQL statement; when it changes nothing, the record
as it is now (or as the statement saw it) is passed to a ``why_*`` function
here, which returns the answer or the error the caller gets. Errors name
fields and never echo values: ids, digests and opaque account data can be
sensitive, and a refused request is no place to reflect them.
"""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass
from typing import Any

from parley_platform import codes
from parley_platform.canonical import InvalidContract
from parley_platform.errors import ParleyError

from . import errors

Row = dict[str, Any]

MAX_ID = 200
MAX_TEXT = 2000
MAX_RESULT_BYTES = 65536
MAX_LEASE_TTL_MS = 60_000
MAX_INTERACTION_TTL_MS = 3_600_000
DEFAULT_INTERACTION_TTL_MS = 300_000
MAX_GENERATION = 2**63 - 1

_HEX64 = re.compile(r"[0-9a-f]{64}")
_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_.:-]{0,127}")
_RESOURCE_KIND = re.compile(r"[a-z][a-z0-9_-]{0,31}")
_CODE = re.compile(r"[a-z][a-z0-9_]{0,63}")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")

EXPIRY = "expiry"  # decided_by / settled_by when the expiry default decided

# ----- field validation ------------------------------------------------------


def invalid(message: str, *, contract: bool) -> ParleyError:
    """A refused field: INVALID_CONTRACT in a contract document or request, else INVALID_ARGUMENT."""
    return InvalidContract(message) if contract else codes.INVALID_ARGUMENT(message)


def agent_uuid(value: str, *, field: str = "agent_id", contract: bool = False) -> uuid.UUID:
    if not value:
        raise invalid(f"{field} is required (the agent's UUID)", contract=contract)
    try:
        return uuid.UUID(value)
    except ValueError:
        raise invalid(f"{field} must be a UUID", contract=contract) from None


def opaque_id(value: str, field: str, *, contract: bool = False, required: bool = True) -> str:
    """An id chosen by the caller: 1–200 characters, no control characters."""
    if not value:
        if required:
            raise invalid(f"{field} is required", contract=contract)
        return value
    if len(value) > MAX_ID or _CONTROL.search(value):
        raise invalid(
            f"{field} must be 1 to {MAX_ID} characters without control characters", contract=contract
        )
    return value


def hex_digest(value: str, field: str, *, contract: bool = True) -> str:
    if not _HEX64.fullmatch(value):
        raise invalid(
            f"{field} must be a SHA-256 digest: 64 lowercase hexadecimal characters", contract=contract
        )
    return value


def name(value: str, field: str, *, contract: bool = False) -> str:
    if not _NAME.fullmatch(value):
        raise invalid(
            f"{field} must start with a letter and use letters, digits and _ . : - (at most 128 characters)",
            contract=contract,
        )
    return value


def code(value: str, field: str) -> str:
    if not _CODE.fullmatch(value):
        raise InvalidContract(f"{field} must be a lower_snake_case code of at most 64 characters")
    return value


def text(value: str, field: str, *, limit: int = MAX_TEXT) -> str:
    if len(value) > limit:
        raise codes.INVALID_ARGUMENT(f"{field} must be at most {limit} characters")
    return value


def resource_kind(value: str, field: str = "resource.kind") -> str:
    if not _RESOURCE_KIND.fullmatch(value):
        raise codes.INVALID_ARGUMENT(
            f"{field} must be a lower-case name such as keyboard, pointer, clipboard or browser"
        )
    return value


def ttl_ms(value: int, field: str, *, maximum: int) -> int:
    if not 1 <= value <= maximum:
        raise codes.INVALID_ARGUMENT(f"{field} must be from 1 to {maximum} milliseconds")
    return value


def generation(value: int, field: str = "generation") -> int:
    if value > MAX_GENERATION:
        raise codes.INVALID_ARGUMENT(f"{field} must be at most 2^63-1")
    return value


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


def already_decided(message: str) -> ParleyError:
    return errors.ACTION_ALREADY_DECIDED(message)


@dataclass(frozen=True)
class DecideAnswer:
    """The answer to a Decide that did not take the claim itself."""

    result: str  # "in_flight" (the same approval, not settled yet) or "recorded" (the same decision, settled)
    row: Row


def why_not_decided(row: Row | None, decision: str) -> DecideAnswer:
    """Decide changed nothing: the same decision is idempotent, anything else is refused."""
    if row is None:
        raise action_not_found()
    if row["status"] == "pending":
        if row["expired"]:
            raise already_decided("the tool call expired before a decision; its expiry default applies")
        # Not expired and still pending cannot follow a failed claim; let the caller retry.
        raise errors.DECIDE_RACE("the tool call changed while deciding")
    if row["decided_by"] == EXPIRY:
        raise already_decided("the tool call expired before a decision; its expiry default applies")
    if row["decision"] != decision:
        raise already_decided(f"the tool call was already decided: {row['decision']}")
    return DecideAnswer("in_flight" if row["status"] == "claimed" else "recorded", row)


def why_not_settled(row: Row | None, claim_token: uuid.UUID, outcome: str, result: str) -> Row:
    """Settle changed nothing: an identical repeat returns the record, anything else is refused."""
    if row is None:
        raise action_not_found()
    if row["status"] == "pending":
        raise errors.ACTION_NOT_CLAIMED("the tool call has not been approved, so there is no claim to settle")
    if row["status"] == "claimed":
        raise errors.STALE_CLAIM_TOKEN("the claim token does not match the claim on this tool call")
    if row["claim_token"] == claim_token and row["outcome"] == outcome and (row["result"] or "") == result:
        return row
    raise errors.ACTION_ALREADY_SETTLED(f"the tool call is already settled ({row['outcome']})")


def conversation_status(rows: list[Row]) -> tuple[bool, bool]:
    """(all decided, all settled) of one assistant message's tool calls; an expired one counts as decided."""
    decided = all(r["status"] != "pending" or r["expired"] for r in rows)
    settled = all(r["status"] == "settled" for r in rows)
    return decided, settled


# ----- 2. capability authorization -------------------------------------------


def stale_authorization(message: str) -> ParleyError:
    return errors.STALE_CAPABILITY_AUTHORIZATION(message)


def untrusted_decision(message: str) -> ParleyError:
    return errors.UNTRUSTED_CAPABILITY_POLICY_DECISION(message)


def stale_confirmation(message: str) -> ParleyError:
    return errors.STALE_CAPABILITY_CONFIRMATION(message)


def refused_outcome(outcome: str, denial_code: str, unavailable_code: str, retryable: bool) -> ParleyError:
    """The error for a decision that grants nothing: RegisterDecision accepts only allowed and
    confirmation_required."""
    if outcome == "denied":
        return errors.CAPABILITY_POLICY_DENIED(f"the policy denied the capability: {denial_code}")
    error = errors.CAPABILITY_UNAVAILABLE(f"the policy could not decide: {unavailable_code}")
    error.retryable = retryable  # type: ignore[misc]  # the policy says whether asking again may help
    return error


def why_not_registered(row: Row, decision_digest: str, id_count: int) -> bool:
    """RegisterDecision recorded nothing. Returns True for a retry of the same registration."""
    if not row["current"]:
        raise stale_authorization("the account snapshot of the request is not current")
    if not row["live"]:
        raise stale_authorization("the decision has already expired")
    if row["registered_digest"] == decision_digest:
        return True
    spent = set(row["spent"] or [])
    reused = [kind for kind in ("decision", "confirmation") if kind not in spent]
    which = "decision_id" if "decision" in reused or id_count == 1 else "confirmation_id"
    raise errors.CAPABILITY_DECISION_REUSED(
        f"{which} has been used before; decision and confirmation ids are usable once, ever"
    )


def why_not_issued(row: Row | None, decision_id: str, decision_digest: str) -> ParleyError:
    if row is None:
        return stale_confirmation("no confirmation with that id is pending for this agent")
    if row["decision_id"] != decision_id or (
        row["decision_exists"] and row["decision_digest"] != decision_digest
    ):
        return stale_confirmation("the confirmation belongs to another decision")
    if row["state"] != "pending":
        return stale_confirmation(f"the confirmation is already {row['state']}")
    if not row["decision_exists"]:
        return stale_authorization("the decision has already been consumed or burned")
    if not row["live"]:
        return stale_authorization("the decision has expired, and its confirmation with it")
    if not row["current"]:
        return stale_authorization("the account snapshot of the decision is not current")
    return errors.ISSUE_RACE("the confirmation changed while issuing it")


@dataclass(frozen=True)
class Refusal:
    """Why Authorize granted nothing, and whether it burned the decision."""

    error: ParleyError
    burned: str | None  # "snapshot" or "expired" when the decision was deleted as dead authority


def why_not_authorized(
    row: Row, *, request_digest: str, decision_digest: str, grant_digest: str | None
) -> Refusal:
    if row["deleted"]:
        if not row["deleted_current"]:
            return Refusal(
                stale_authorization(
                    "the account snapshot is no longer current; the decision has been burned"
                ),
                "snapshot",
            )
        return Refusal(stale_authorization("the decision has expired; it has been burned"), "expired")
    if row["seen_request_digest"] is None:
        if row["known"]:
            return Refusal(stale_authorization("the decision has already been consumed or burned"), None)
        return Refusal(untrusted_decision("no decision with that id was registered for this agent"), None)
    if row["seen_decision_digest"] != decision_digest:
        return Refusal(untrusted_decision("decision_digest does not match the registered decision"), None)
    if row["seen_request_digest"] != request_digest:
        return Refusal(untrusted_decision("the decision was not issued for this request"), None)
    if row["seen_confirmation_id"] is None:
        if grant_digest is not None:
            return Refusal(
                InvalidContract("grant is given for a decision that requires no confirmation"), None
            )
    elif grant_digest is None or row["seen_confirmation_state"] == "pending":
        if row["seen_confirmation_state"] == "pending":
            return Refusal(
                errors.CAPABILITY_CONFIRMATION_REQUIRED(
                    "the decision requires a confirmation that has not been issued"
                ),
                None,
            )
        return Refusal(
            errors.CAPABILITY_CONFIRMATION_REQUIRED("the decision requires a confirmation: pass its grant"),
            None,
        )
    elif row["seen_grant_digest"] != grant_digest or row["seen_confirmation_state"] != "issued":
        return Refusal(stale_confirmation("the grant is not the current grant of this decision"), None)
    # Everything matched in the statement's snapshot: a concurrent caller consumed it first.
    return Refusal(stale_authorization("the decision has already been consumed"), None)


RECEIPT_BINDINGS = (
    "request_digest",
    "decision_digest",
    "grant_digest",
    "account_id",
    "capability",
    "operation",
    "input_digest",
)


def why_not_recorded(row: Row, receipt: dict[str, Any], receipt_digest: str) -> bool:
    """RecordReceipt recorded nothing. Returns True for a repeat of the same receipt."""
    if not row["authorization_exists"]:
        raise errors.AUTHORIZATION_NOT_FOUND("no authorization with that id for this agent")
    for field in RECEIPT_BINDINGS:
        if (row[field] or None) != (receipt[field] or None):
            raise InvalidContract(f"receipt.{field} does not match the authorization")
    if receipt["idempotency_key"] != row["request_digest"]:
        raise InvalidContract("receipt.idempotency_key must equal the authorization's request_digest")
    if row["existing_digest"] is not None:
        if row["existing_digest"] == receipt_digest:
            return True
        raise errors.RECEIPT_CONFLICT("a different receipt was already recorded for this authorization")
    first = receipt["committed_at"] or receipt["observed_at"]
    if first < row["authorized_at"]:
        field = "committed_at" if receipt["committed_at"] else "observed_at"
        raise InvalidContract(f"receipt.{field} precedes the authorization")
    if receipt["observed_at"] > row["db_now"]:
        raise InvalidContract("receipt.observed_at is in the future")
    raise errors.RECEIPT_RACE("the receipt changed while recording it")


# ----- 3. interaction leases ---------------------------------------------------


def lease_conflict(message: str) -> ParleyError:
    return errors.LEASE_CONFLICT(message)


def stale_lease(message: str) -> ParleyError:
    return errors.STALE_LEASE(message)


def same_holder(row: Row, lease_id: str, session_id: str, owner: str, generation: int) -> bool:
    return bool(
        row["lease_id"] == lease_id
        and row["session_id"] == session_id
        and row["owner"] == owner
        and row["generation"] == generation
    )


def check_leases(
    rows: list[Row],
    *,
    lease_ids: list[str],
    session_id: str,
    owner: str,
    generation: int,
    required: list[tuple[str, str]],
) -> list[Row]:
    """Every named lease is live and held by this session/owner/generation, and every required
    resource is covered by one of them. Liveness is the database's (``live`` in each row)."""
    by_id = {row["lease_id"]: row for row in rows}
    for index, lease_id in enumerate(lease_ids):
        row = by_id.get(lease_id)
        if row is None or not row["live"]:
            raise stale_lease(f"lease_ids[{index}] is not held (released, expired or taken over)")
        if not same_holder(row, lease_id, session_id, owner, generation):
            raise stale_lease(f"lease_ids[{index}] is held by another session, owner or generation")
    covered = {(by_id[i]["resource_kind"], by_id[i]["resource_id"]) for i in lease_ids}
    for index, resource in enumerate(required):
        if resource not in covered:
            raise stale_lease(f"required.resources[{index}] ({resource[0]}) is not covered by a live lease")
    return [by_id[i] for i in dict.fromkeys(lease_ids)]


# ----- 4. interaction confirmations -------------------------------------------


def stale_interaction(message: str) -> ParleyError:
    return errors.STALE_INTERACTION_CONFIRMATION(message)


def interaction_mismatch(message: str) -> ParleyError:
    return errors.INTERACTION_CONFIRMATION_MISMATCH(message)


def why_not_issued_interaction(row: Row | None, action_digest: str) -> ParleyError:
    if row is None:
        return stale_interaction("no interaction confirmation with that id for this agent")
    if row["state"] != "pending":
        return stale_interaction(f"the interaction confirmation is already {row['state']}")
    if not row["live"]:
        return stale_interaction("the interaction confirmation has expired")
    if row["action_digest"] != action_digest:
        return interaction_mismatch("action_digest is not the digest of the registered action")
    return errors.ISSUE_RACE("the confirmation changed while issuing it")


def why_not_consumed_interaction(row: Row, grant_id: str, action_digest: str) -> ParleyError:
    state = row["seen_state"]
    if state is None:
        return stale_interaction("no interaction confirmation with that id for this agent")
    if state == "consumed":
        return stale_interaction("the interaction confirmation has already been used")
    if state == "pending":
        return stale_interaction("the interaction confirmation has not been issued")
    if not row["seen_live"]:
        return stale_interaction("the interaction confirmation has expired")
    if row["seen_grant_id"] != grant_id:
        return interaction_mismatch("grant_id is not the grant of this confirmation")
    if row["seen_action_digest"] != action_digest:
        return interaction_mismatch("the action differs from the one that was confirmed")
    return stale_interaction("the interaction confirmation has already been used")
