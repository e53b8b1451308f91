"""Authz's records: what the store returns and the rules reason about, and their wire form.

A record read from the database is built by ``from_row``, which only the store calls: its
fields are the result's columns, named alike, so a query and its record read side by side.
``to_proto`` is the record as answered. The inputs of a state change (a proposal, a verdict,
a holder) are typed too: the store takes them instead of parameter dicts.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import dataclass, fields
from datetime import datetime
from typing import Any, Literal, Self

from parley.v1 import authz_pb2
from parley_platform.convert import timestamp

VERSION = 1  # of the capability contracts (requests, decisions, grants, receipts)

ToolCallStatus = Literal["pending", "claimed", "settled"]
ToolDecision = Literal["approve", "deny"]
ToolOutcome = Literal["success", "failure", "indeterminate", "denied", "expired"]
SettleOutcome = Literal["success", "failure", "indeterminate"]
InteractionState = Literal["pending", "issued", "consumed"]

STATUSES: dict[ToolCallStatus, authz_pb2.ToolCallStatus.ValueType] = {
    "pending": authz_pb2.TOOL_CALL_STATUS_PENDING,
    "claimed": authz_pb2.TOOL_CALL_STATUS_CLAIMED,
    "settled": authz_pb2.TOOL_CALL_STATUS_SETTLED,
}
DECISIONS: dict[ToolDecision, authz_pb2.ToolDecision.ValueType] = {
    "approve": authz_pb2.TOOL_DECISION_APPROVE,
    "deny": authz_pb2.TOOL_DECISION_DENY,
}
DECISION_NAMES: dict[int, ToolDecision] = {value: key for key, value in DECISIONS.items()}
OUTCOMES: dict[ToolOutcome, authz_pb2.ToolOutcome.ValueType] = {
    "success": authz_pb2.TOOL_OUTCOME_SUCCESS,
    "failure": authz_pb2.TOOL_OUTCOME_FAILURE,
    "indeterminate": authz_pb2.TOOL_OUTCOME_INDETERMINATE,
    "denied": authz_pb2.TOOL_OUTCOME_DENIED,
    "expired": authz_pb2.TOOL_OUTCOME_EXPIRED,
}
SETTLE_OUTCOMES: dict[int, SettleOutcome] = {
    authz_pb2.TOOL_OUTCOME_SUCCESS: "success",
    authz_pb2.TOOL_OUTCOME_FAILURE: "failure",
    authz_pb2.TOOL_OUTCOME_INDETERMINATE: "indeterminate",
}
INTERACTION_STATES: dict[InteractionState, authz_pb2.InteractionConfirmationState.ValueType] = {
    "pending": authz_pb2.INTERACTION_CONFIRMATION_STATE_PENDING,
    "issued": authz_pb2.INTERACTION_CONFIRMATION_STATE_ISSUED,
    "consumed": authz_pb2.INTERACTION_CONFIRMATION_STATE_CONSUMED,
}


_FIELD_NAMES: dict[type, tuple[str, ...]] = {}


def field_names(cls: Any) -> tuple[str, ...]:
    """A dataclass's field names, looked up once per class (``fields`` walks the class each call)."""
    names = _FIELD_NAMES.get(cls)
    if names is None:
        names = _FIELD_NAMES[cls] = tuple(f.name for f in fields(cls))
    return names


@dataclass(frozen=True)
class Record:
    @classmethod
    def from_row(cls, row: Mapping[str, Any], prefix: str = "") -> Self:
        """The record of a result row whose columns are its fields' names after ``prefix``."""
        return cls(**{name: row[prefix + name] for name in field_names(cls)})


# ----- 1. tool-call decisions -------------------------------------------------------------


@dataclass(frozen=True)
class Claim:
    """The approval's claim: only the executor holding this token runs and settles the call."""

    token: uuid.UUID
    claimed_at: datetime


@dataclass(frozen=True)
class ToolCall(Record):
    """One proposed tool call: pending, then claimed (approved) or settled (denied, expired, run)."""

    agent_id: uuid.UUID
    id: str
    conversation_id: str
    message_id: str
    call_index: int
    tool: str
    args_digest: str
    summary: str
    proposed_at: datetime
    expires_at: datetime | None
    on_expiry: ToolDecision
    status: ToolCallStatus
    decision: ToolDecision | None
    reason: str | None
    decided_by: str | None
    decided_at: datetime | None
    claim_token: uuid.UUID | None
    claimed_at: datetime | None
    outcome: ToolOutcome | None
    result: str | None
    settled_by: str | None
    settled_at: datetime | None
    expired: bool  # still pending past expires_at, by the database's clock when it was read

    @property
    def claim(self) -> Claim | None:
        if self.claim_token is None or self.claimed_at is None:
            return None
        return Claim(self.claim_token, self.claimed_at)

    def to_proto(self, *, with_claim: bool = False) -> authz_pb2.ToolCall:
        """The call as answered; the claim token only to whoever may settle with it."""
        call = authz_pb2.ToolCall(
            agent_id=str(self.agent_id),
            tool_call_id=self.id,
            conversation_id=self.conversation_id,
            message_id=self.message_id,
            call_index=self.call_index,
            tool=self.tool,
            args_digest=self.args_digest,
            summary=self.summary,
            proposed_at=timestamp(self.proposed_at),
            expires_at=timestamp(self.expires_at),
            on_expiry=DECISIONS[self.on_expiry],
            status=STATUSES[self.status],
            decision=DECISIONS[self.decision] if self.decision else authz_pb2.TOOL_DECISION_UNSPECIFIED,
            reason=self.reason or "",
            decided_by=self.decided_by or "",
            decided_at=timestamp(self.decided_at),
            outcome=OUTCOMES[self.outcome] if self.outcome else authz_pb2.TOOL_OUTCOME_UNSPECIFIED,
            result=self.result or "",
            settled_by=self.settled_by or "",
            settled_at=timestamp(self.settled_at),
        )
        claim = self.claim
        if with_claim and claim is not None:
            call.claim.CopyFrom(
                authz_pb2.ToolCallClaim(token=str(claim.token), claimed_at=timestamp(claim.claimed_at))
            )
        return call


@dataclass(frozen=True)
class Proposal:
    """A PutPending request, checked. ``proposed_at`` None is the database's now."""

    agent_id: uuid.UUID
    id: str
    conversation_id: str
    message_id: str
    call_index: int
    tool: str
    args_digest: str
    summary: str
    proposed_at: datetime | None
    expires_at: datetime | None
    on_expiry: ToolDecision


@dataclass(frozen=True)
class Verdict:
    """A person's decision on a pending call; an approval carries the fresh claim token."""

    agent_id: uuid.UUID
    id: str
    decision: ToolDecision
    reason: str | None
    decided_by: str
    claim_token: uuid.UUID | None


@dataclass(frozen=True)
class Settlement:
    """What the claim's holder reports after running the call."""

    agent_id: uuid.UUID
    id: str
    claim_token: uuid.UUID
    outcome: SettleOutcome
    result: str
    settled_by: str


@dataclass(frozen=True)
class Gauge(Record):
    """Live pending items of one kind (and live leases), with the age of the oldest."""

    kind: str
    n: int
    oldest_seconds: float


# ----- 2. capability authorization --------------------------------------------------------


@dataclass(frozen=True)
class SnapshotPut(Record):
    created: bool
    current: bool  # the version is the account's current snapshot after the statement


@dataclass(frozen=True)
class BoundRequest:
    """A capability request bound to an account snapshot, checked, with its digest."""

    agent_id: uuid.UUID
    account_id: str
    snapshot_version: str
    capability: str
    operation: str
    risk: str
    input_digest: str
    bound_at: datetime
    digest: str


@dataclass(frozen=True)
class CheckedDecision:
    """A policy decision for a bound request, checked, with its digest."""

    decision_id: str
    outcome: str
    confirmation_id: str | None
    denial_code: str
    unavailable_code: str
    retryable: bool
    issued_at: datetime
    expires_at: datetime
    digest: str

    @property
    def id_count(self) -> int:
        """How many once-ever ids registering it spends: the decision's, and its confirmation's."""
        return 2 if self.confirmation_id else 1


@dataclass(frozen=True)
class Registration(Record):
    """What RegisterDecision's statement saw and did."""

    current: bool  # the request's account snapshot is current
    live: bool  # the decision has not expired
    created: bool
    spent: list[str]  # the kinds of id ("decision", "confirmation") this statement spent
    registered_digest: str | None  # of the live decision registered under the decision_id, if any


@dataclass(frozen=True)
class ConfirmationGrant:
    """A person's confirmation of one decision; ``digest`` is set once the grant is complete."""

    agent_id: uuid.UUID
    confirmation_id: str
    decision_id: str
    decision_digest: str
    grant_id: str
    issued_at: datetime
    digest: str = ""

    def to_proto(self) -> authz_pb2.ConfirmationGrant:
        return authz_pb2.ConfirmationGrant(
            version=VERSION,
            agent_id=str(self.agent_id),
            confirmation_id=self.confirmation_id,
            decision_id=self.decision_id,
            decision_digest=self.decision_digest,
            grant_id=self.grant_id,
            issued_at=timestamp(self.issued_at),
            digest=self.digest,
        )


@dataclass(frozen=True)
class ConfirmationSeen(Record):
    """A capability confirmation and its decision as they are, to say why issuing changed nothing."""

    state: str
    decision_id: str
    decision_digest: str | None  # None once the decision is gone (consumed or burned)
    live: bool
    current: bool
    decision_exists: bool


@dataclass(frozen=True)
class AuthorizationAttempt:
    """An Authorize request, checked: the decision presented for a request, with its grant."""

    agent_id: uuid.UUID
    decision_id: str
    decision_digest: str
    request_digest: str
    grant_digest: str | None
    authorization_id: str


@dataclass(frozen=True)
class Authorization(Record):
    """What Authorize granted, once per decision; a receipt cites it."""

    id: str
    agent_id: uuid.UUID
    request_digest: str
    decision_id: str
    decision_digest: str
    grant_digest: str | None
    account_id: str
    snapshot_version: str
    capability: str
    operation: str
    risk: str
    input_digest: str
    authorized_at: datetime

    def to_proto(self) -> authz_pb2.CapabilityAuthorization:
        return authz_pb2.CapabilityAuthorization(
            id=self.id,
            agent_id=str(self.agent_id),
            request_digest=self.request_digest,
            decision_id=self.decision_id,
            decision_digest=self.decision_digest,
            grant_digest=self.grant_digest or "",
            account_id=self.account_id,
            snapshot_version=self.snapshot_version,
            capability=self.capability,
            operation=self.operation,
            risk=authz_pb2.RiskLevel.Value("RISK_LEVEL_" + self.risk),
            input_digest=self.input_digest,
            authorized_at=timestamp(self.authorized_at),
        )


@dataclass(frozen=True)
class SeenDecision(Record):
    """The live decision as Authorize's statement saw it, with its confirmation."""

    request_digest: str
    decision_digest: str
    confirmation_id: str | None
    live: bool
    current: bool
    confirmation_state: str | None
    grant_digest: str | None


@dataclass(frozen=True)
class AuthorizeOutcome:
    """What Authorize's one statement did: an authorization, or what it saw and deleted instead."""

    authorization: Authorization | None
    deleted: bool  # the decision was deleted: consumed, or burned as dead authority
    deleted_current: bool | None  # its snapshot was current when deleted (else burned for the snapshot)
    seen: SeenDecision | None  # None: no live decision with that id
    known: bool  # the decision id was ever registered


@dataclass(frozen=True)
class CheckedReceipt:
    """An effect receipt, checked, with its digest."""

    authorization_id: str
    request_digest: str
    decision_digest: str
    grant_digest: str | None
    account_id: str
    capability: str
    operation: str
    input_digest: str
    idempotency_key: str
    status: str
    error_code: str | None
    committed_at: datetime | None
    observed_at: datetime
    digest: str


@dataclass(frozen=True)
class ExistingReceipt(Record):
    digest: str
    recorded_at: datetime


@dataclass(frozen=True)
class ReceiptOutcome:
    """What RecordReceipt's statement did: recorded, or what it found instead."""

    recorded_at: datetime | None  # set when this statement recorded the receipt
    db_now: datetime
    authorization: Authorization | None
    existing: ExistingReceipt | None


# ----- 3. interaction leases --------------------------------------------------------------


@dataclass(frozen=True)
class Holder:
    """Who holds (or asks for) a lease: the lease id, and the session, owner and generation."""

    agent_id: uuid.UUID
    lease_id: str
    session_id: str
    owner: str
    generation: int


@dataclass(frozen=True)
class Lease(Record):
    agent_id: uuid.UUID
    lease_id: str
    resource_kind: str
    resource_id: str
    session_id: str
    owner: str
    generation: int
    fencing_token: int
    acquired_at: datetime
    renewed_at: datetime
    expires_at: datetime
    live: bool  # by the database's clock when it was read

    def to_proto(self) -> authz_pb2.InteractionLease:
        return authz_pb2.InteractionLease(
            agent_id=str(self.agent_id),
            lease_id=self.lease_id,
            resource=authz_pb2.LeaseResource(kind=self.resource_kind, id=self.resource_id),
            session_id=self.session_id,
            owner=self.owner,
            generation=self.generation,
            fencing_token=self.fencing_token,
            acquired_at=timestamp(self.acquired_at),
            renewed_at=timestamp(self.renewed_at),
            expires_at=timestamp(self.expires_at),
        )


@dataclass(frozen=True)
class Release(Record):
    released: bool
    held: bool  # the lease id was held (by anyone) when the statement ran


# ----- 4. interaction confirmations -------------------------------------------------------


@dataclass(frozen=True)
class InteractionConfirmation(Record):
    agent_id: uuid.UUID
    confirmation_id: str
    action_digest: str
    state: InteractionState
    grant_id: str | None
    created_at: datetime
    expires_at: datetime
    live: bool  # by the database's clock when it was read

    def to_proto(self) -> authz_pb2.InteractionConfirmation:
        return authz_pb2.InteractionConfirmation(
            agent_id=str(self.agent_id),
            confirmation_id=self.confirmation_id,
            action_digest=self.action_digest,
            state=INTERACTION_STATES[self.state],
            grant_id=self.grant_id or "",
            created_at=timestamp(self.created_at),
            expires_at=timestamp(self.expires_at),
        )


@dataclass(frozen=True)
class SeenInteraction(Record):
    """The confirmation as Consume's statement saw it, to say why nothing was consumed."""

    state: InteractionState
    grant_id: str | None
    action_digest: str
    live: bool


@dataclass(frozen=True)
class Consumption:
    consumed: InteractionConfirmation | None
    seen: SeenInteraction | None  # None: no confirmation with that id
