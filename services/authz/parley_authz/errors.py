"""The authz service's error codes.

Malformed contract documents and requests are ``InvalidContract`` (code INVALID_CONTRACT, from
``parley_platform.canonical``), which callers catch by type; plain bad fields are the platform's
INVALID_ARGUMENT.
"""

from __future__ import annotations

from parley_platform.errors import Catalog, Kind

CATALOG = Catalog(
    "authz",
    "The authz service: tool-call approvals, one-shot capability authorization, interaction leases "
    "and interaction confirmations.",
)
define = CATALOG.define

# ----- tool-call decisions ----------------------------------------------------------------

ACTION_NOT_FOUND = define(
    "ACTION_NOT_FOUND",
    Kind.NOT_FOUND,
    "No tool call with that id was proposed for this agent.",
    hint="list the pending ones with `parley approvals list`",
)
TOOL_CALL_ID_REUSED = define(
    "TOOL_CALL_ID_REUSED",
    Kind.CONFLICT,
    "The tool_call_id already names a different proposal (another message, call slot, tool or arguments).",
    hint="every proposal needs its own tool_call_id",
)
TOOL_CALL_CONFLICT = define(
    "TOOL_CALL_CONFLICT",
    Kind.CONFLICT,
    "Another tool call already occupies this message_id and call_index.",
    hint="each call of an assistant message has its own call_index",
)
PUT_RACE = define(
    "PUT_RACE",
    Kind.CONFLICT,
    "The tool call changed while the proposal was being recorded; proposing it again answers it.",
    retryable=True,
)
ACTION_ALREADY_DECIDED = define(
    "ACTION_ALREADY_DECIDED",
    Kind.CONFLICT,
    "The tool call was already decided the other way, or expired and its expiry default decided it.",
    hint="a new proposal needs a new tool_call_id",
)
DECIDE_RACE = define(
    "DECIDE_RACE",
    Kind.CONFLICT,
    "The tool call changed while the decision was being recorded; deciding again answers it.",
    retryable=True,
)
ACTION_NOT_CLAIMED = define(
    "ACTION_NOT_CLAIMED",
    Kind.FAILED_PRECONDITION,
    "Settle was called for a tool call nobody approved yet, so there is no claim to settle.",
)
STALE_CLAIM_TOKEN = define(
    "STALE_CLAIM_TOKEN",
    Kind.CONFLICT,
    "The claim token is not the one the tool call was claimed with.",
    hint="only the executor holding the claim, or an operator with the token from "
    "`parley approvals stuck`, can settle it",
)
ACTION_ALREADY_SETTLED = define(
    "ACTION_ALREADY_SETTLED",
    Kind.FAILED_PRECONDITION,
    "The tool call is already settled with another outcome or result.",
    hint="an outcome is terminal",
)

# ----- capability authorization ------------------------------------------------------------

SNAPSHOT_VERSION_RETIRED = define(
    "SNAPSHOT_VERSION_RETIRED",
    Kind.FAILED_PRECONDITION,
    "The account snapshot version was current once and has been replaced or revoked; it never "
    "becomes current again.",
    hint="a reconnected account gets a new snapshot version",
)
CAPABILITY_POLICY_DENIED = define(
    "CAPABILITY_POLICY_DENIED",
    Kind.PERMISSION_DENIED,
    "The policy decision denies the capability, so there is nothing to register.",
)
CAPABILITY_UNAVAILABLE = define(
    "CAPABILITY_UNAVAILABLE",
    Kind.UNAVAILABLE,
    "The policy could not decide; retryable when the policy decision says so.",
)
CAPABILITY_DECISION_REUSED = define(
    "CAPABILITY_DECISION_REUSED",
    Kind.CONFLICT,
    "The decision_id or confirmation_id was registered before; each is usable once, ever.",
    hint="ask the policy for a new decision",
)
STALE_CAPABILITY_AUTHORIZATION = define(
    "STALE_CAPABILITY_AUTHORIZATION",
    Kind.FAILED_PRECONDITION,
    "The decision no longer authorizes anything: it was consumed or burned, it expired, or its "
    "account snapshot is no longer current.",
    hint="evaluate the policy again for the current account snapshot",
)
UNTRUSTED_CAPABILITY_POLICY_DECISION = define(
    "UNTRUSTED_CAPABILITY_POLICY_DECISION",
    Kind.PERMISSION_DENIED,
    "The decision presented was never registered for this agent and this exact request.",
    hint="only a decision registered for this exact request authorizes it",
)
STALE_CAPABILITY_CONFIRMATION = define(
    "STALE_CAPABILITY_CONFIRMATION",
    Kind.FAILED_PRECONDITION,
    "The confirmation or its grant does not belong to this decision, or was already issued, "
    "consumed or burned.",
    hint="a confirmation is issued for one decision and used once",
)
CAPABILITY_CONFIRMATION_REQUIRED = define(
    "CAPABILITY_CONFIRMATION_REQUIRED",
    Kind.FAILED_PRECONDITION,
    "The decision requires a person's confirmation, and no issued grant for it was passed.",
    hint="issue the confirmation, then authorize with its grant",
)
ISSUE_RACE = define(
    "ISSUE_RACE",
    Kind.CONFLICT,
    "The confirmation changed while it was being issued; issuing again answers why.",
    retryable=True,
)
AUTHORIZATION_NOT_FOUND = define(
    "AUTHORIZATION_NOT_FOUND",
    Kind.NOT_FOUND,
    "The receipt cites an authorization that does not exist for this agent.",
)
RECEIPT_CONFLICT = define(
    "RECEIPT_CONFLICT",
    Kind.CONFLICT,
    "A different receipt was already recorded for this authorization; a receipt is recorded once.",
)
RECEIPT_RACE = define(
    "RECEIPT_RACE",
    Kind.CONFLICT,
    "The authorization's receipt changed while this one was being recorded; recording again answers why.",
    retryable=True,
)

# ----- interaction leases ------------------------------------------------------------------

LEASE_CONFLICT = define(
    "LEASE_CONFLICT",
    Kind.CONFLICT,
    "The resource is held by another live lease, or the lease_id is held or bound by someone else.",
    hint="wait for the holder to release it or for it to expire",
)
STALE_LEASE = define(
    "STALE_LEASE",
    Kind.FAILED_PRECONDITION,
    "A lease is no longer held by this session, owner and generation (released, expired or taken "
    "over), or no live lease covers a required resource.",
    hint="acquire the resource again",
)
LEASE_REQUIREMENTS_MISSING = define(
    "LEASE_REQUIREMENTS_MISSING",
    Kind.INVALID_ARGUMENT,
    "AssertLeases was called without its required list; an action that needs no resource passes "
    "an empty one.",
    hint="an omitted list is refused so that forgetting it cannot disable lease enforcement",
)

# ----- interaction confirmations -----------------------------------------------------------

INTERACTION_CONFIRMATION_REUSED = define(
    "INTERACTION_CONFIRMATION_REUSED",
    Kind.CONFLICT,
    "The confirmation_id was registered before for another action, or is no longer pending; "
    "interaction confirmations are usable once.",
)
STALE_INTERACTION_CONFIRMATION = define(
    "STALE_INTERACTION_CONFIRMATION",
    Kind.FAILED_PRECONDITION,
    "The interaction confirmation does not exist, has expired, is not issued yet or was already used.",
    hint="register and confirm the action again",
)
INTERACTION_CONFIRMATION_MISMATCH = define(
    "INTERACTION_CONFIRMATION_MISMATCH",
    Kind.FAILED_PRECONDITION,
    "The grant or the action is not the one the person confirmed.",
    hint="the action dispatched must be exactly the one the person confirmed",
)
