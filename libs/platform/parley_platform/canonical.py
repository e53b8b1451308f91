"""Canonical JSON and the domain-separated SHA-256 digests of the authorization contracts.

A digest is ``sha256(domain + "\\n" + canonical_json(document))`` in lowercase hex.
Canonical JSON is RFC 8785 (JCS) restricted to what every language encodes the
same way:

- objects with string keys sorted by their UTF-16 code units, arrays, strings,
  ``true``, ``false``, ``null`` and integers in [-(2^53-1), 2^53-1];
- a number with a fraction or an exponent is refused (so are NaN and the
  infinities): nothing depends on how a float prints;
- no whitespace outside strings; strings escape ``"`` and ``\\``, use
  ``\\b \\f \\n \\r \\t``, ``\\u00xx`` (lowercase) for the other control
  characters, and leave every other character as it is;
- encoded as UTF-8; a lone surrogate cannot be encoded and is refused.

Timestamps enter documents as integer milliseconds since the Unix epoch.

Services compute digests with these functions instead of re-implementing the
rules, so the bytes that are hashed are the same everywhere. Errors name the
offending field and never echo its value, which may be a secret.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from typing import Any

from google.protobuf.timestamp_pb2 import Timestamp

from parley.v1 import authz_pb2

from . import codes
from .errors import InvalidArgument

MAX_SAFE_INTEGER = 2**53 - 1
MAX_DEPTH = 32

CAPABILITY_REQUEST = "parley:capability-request:v1"
CAPABILITY_DECISION = "parley:capability-decision:v1"
CAPABILITY_CONFIRMATION = "parley:capability-confirmation:v1"
CAPABILITY_AUTHORIZATION = "parley:capability-authorization:v1"
CAPABILITY_RECEIPT = "parley:capability-receipt:v1"
INTERACTION_ACTION = "parley:interaction-action:v1"
TOOL_ARGUMENTS = "parley:tool-arguments:v1"

# Keys of an interaction action that are assigned after its preview was confirmed.
INTERACTION_UNBOUND_KEYS = frozenset({"grant_id", "lease_ids"})


class InvalidContract(InvalidArgument):
    """A contract document or request that does not follow the rules; names the field, not the value."""

    default_code = codes.INVALID_CONTRACT.code


def _encode_string(value: str, path: str) -> str:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidContract(f"{path} contains a lone surrogate, which is not valid UTF-8") from None
    return json.dumps(value, ensure_ascii=False)


def _utf16_key(key: str) -> bytes:
    return key.encode("utf-16-be", "surrogatepass")


def _write(value: Any, path: str, depth: int, out: list[str]) -> None:
    if depth > MAX_DEPTH:
        raise InvalidContract(f"{path} is nested deeper than {MAX_DEPTH} levels")
    if value is None:
        out.append("null")
    elif value is True:
        out.append("true")
    elif value is False:
        out.append("false")
    elif isinstance(value, int):
        if not -MAX_SAFE_INTEGER <= value <= MAX_SAFE_INTEGER:
            raise InvalidContract(f"{path} is an integer outside ±(2^53-1)")
        out.append(str(int(value)))
    elif isinstance(value, float):
        raise InvalidContract(f"{path} is a number with a fraction or exponent; only integers are allowed")
    elif isinstance(value, str):
        out.append(_encode_string(value, path))
    elif isinstance(value, Mapping):
        for key in value:
            if not isinstance(key, str):
                raise InvalidContract(f"{path} has a key that is not a string")
        out.append("{")
        for index, key in enumerate(sorted(value, key=_utf16_key)):
            if index:
                out.append(",")
            out.append(_encode_string(key, f"{path} key"))
            out.append(":")
            _write(value[key], f"{path}.{key}", depth + 1, out)
        out.append("}")
    elif isinstance(value, Sequence) and not isinstance(value, bytes | bytearray):
        out.append("[")
        for index, item in enumerate(value):
            if index:
                out.append(",")
            _write(item, f"{path}[{index}]", depth + 1, out)
        out.append("]")
    else:
        raise InvalidContract(f"{path} is a {type(value).__name__}, which JSON cannot hold")


def canonical_json(value: Any, *, path: str = "document") -> bytes:
    """The canonical UTF-8 bytes of ``value`` (see the module docstring for the rules)."""
    out: list[str] = []
    _write(value, path, 0, out)
    return "".join(out).encode("utf-8")


def digest(domain: str, value: Any, *, path: str = "document") -> str:
    """``sha256(domain + "\\n" + canonical JSON)`` as lowercase hex."""
    return hashlib.sha256(domain.encode("utf-8") + b"\n" + canonical_json(value, path=path)).hexdigest()


def _refuse_float(_text: str) -> Any:
    raise ValueError("fraction")


def _refuse_constant(_text: str) -> Any:
    raise ValueError("constant")


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    found: dict[str, Any] = {}
    for key, value in pairs:
        if key in found:
            raise ValueError("duplicate")
        found[key] = value
    return found


def parse_json(text: str, *, what: str, max_bytes: int = 65536) -> Any:
    """Parse JSON strictly: no duplicate keys, integers only, bounded size and depth.

    The result is ready for ``canonical_json`` (which enforces the remaining rules)."""
    if len(text.encode("utf-8", "surrogatepass")) > max_bytes:
        raise InvalidContract(f"{what} is longer than {max_bytes} bytes")
    try:
        value = json.loads(
            text,
            parse_float=_refuse_float,
            parse_constant=_refuse_constant,
            object_pairs_hook=_no_duplicates,
        )
    except json.JSONDecodeError as exc:
        raise InvalidContract(f"{what} is not valid JSON (at character {exc.pos})") from None
    except RecursionError:
        raise InvalidContract(f"{what} is nested deeper than {MAX_DEPTH} levels") from None
    except ValueError as exc:
        reason = {
            "fraction": "has a number with a fraction or exponent; only integers are allowed",
            "constant": "has NaN or Infinity, which JSON does not allow",
            "duplicate": "has a duplicate key in one object",
        }.get(str(exc), "is not valid JSON")
        raise InvalidContract(f"{what} {reason}") from None
    canonical_json(value, path=what)  # the remaining rules: integer range, depth, encodable strings
    return value


def millis(ts: Timestamp) -> int:
    """A timestamp as integer milliseconds (callers have checked it is whole milliseconds)."""
    return ts.seconds * 1000 + ts.nanos // 1_000_000


def _lower_name(enum: Any, value: int, prefix: str) -> str:
    return str(enum.Name(value)).removeprefix(prefix).lower()


def risk_name(value: authz_pb2.RiskLevel.ValueType) -> str:
    return str(authz_pb2.RiskLevel.Name(value)).removeprefix("RISK_LEVEL_")


def request_document(request: authz_pb2.CapabilityRequest) -> dict[str, Any]:
    return {
        "version": request.version,
        "agent_id": request.agent_id,
        "account_id": request.account_id,
        "snapshot_version": request.snapshot_version,
        "capability": request.capability,
        "operation": request.operation,
        "catalog_risk": risk_name(request.catalog_risk),
        "risk": risk_name(request.risk),
        "input_digest": request.input_digest,
        "bound_at": millis(request.bound_at),
    }


def request_digest(request: authz_pb2.CapabilityRequest) -> str:
    return digest(CAPABILITY_REQUEST, request_document(request), path="request")


def decision_document(decision: authz_pb2.PolicyDecision) -> dict[str, Any]:
    outcome = decision.outcome
    confirming = outcome == authz_pb2.POLICY_OUTCOME_CONFIRMATION_REQUIRED
    denied = outcome == authz_pb2.POLICY_OUTCOME_DENIED
    unavailable = outcome == authz_pb2.POLICY_OUTCOME_UNAVAILABLE
    return {
        "version": decision.version,
        "decision_id": decision.decision_id,
        "request_digest": decision.request_digest,
        "outcome": _lower_name(authz_pb2.PolicyOutcome, outcome, "POLICY_OUTCOME_"),
        "confirmation_id": decision.confirmation_id if confirming else None,
        "denial_code": (
            _lower_name(authz_pb2.PolicyDenialCode, decision.denial_code, "POLICY_DENIAL_CODE_")
            if denied
            else None
        ),
        "unavailable_code": decision.unavailable_code if unavailable else None,
        "retryable": decision.retryable if unavailable else None,
        "issued_at": millis(decision.issued_at),
        "expires_at": millis(decision.expires_at),
    }


def decision_digest(decision: authz_pb2.PolicyDecision) -> str:
    return digest(CAPABILITY_DECISION, decision_document(decision), path="decision")


def grant_document(grant: authz_pb2.ConfirmationGrant) -> dict[str, Any]:
    return {
        "version": grant.version,
        "agent_id": grant.agent_id,
        "confirmation_id": grant.confirmation_id,
        "decision_id": grant.decision_id,
        "decision_digest": grant.decision_digest,
        "grant_id": grant.grant_id,
        "issued_at": millis(grant.issued_at),
    }


def grant_digest(grant: authz_pb2.ConfirmationGrant) -> str:
    return digest(CAPABILITY_CONFIRMATION, grant_document(grant), path="grant")


def authorization_id(
    agent_id: str, request_digest: str, decision_digest: str, grant_digest: str | None
) -> str:
    return digest(
        CAPABILITY_AUTHORIZATION,
        {
            "agent_id": agent_id,
            "request_digest": request_digest,
            "decision_digest": decision_digest,
            "grant_digest": grant_digest,
        },
    )


def receipt_document(receipt: authz_pb2.EffectReceipt) -> dict[str, Any]:
    committed = receipt.status == authz_pb2.EFFECT_STATUS_COMMITTED
    return {
        "version": receipt.version,
        "authorization_id": receipt.authorization_id,
        "request_digest": receipt.request_digest,
        "decision_digest": receipt.decision_digest,
        "grant_digest": receipt.grant_digest or None,
        "account_id": receipt.account_id,
        "capability": receipt.capability,
        "operation": receipt.operation,
        "input_digest": receipt.input_digest,
        "idempotency_key": receipt.idempotency_key,
        "status": _lower_name(authz_pb2.EffectStatus, receipt.status, "EFFECT_STATUS_"),
        "error_code": (
            None
            if committed
            else _lower_name(authz_pb2.ExecutionErrorCode, receipt.error_code, "EXECUTION_ERROR_CODE_")
        ),
        "committed_at": millis(receipt.committed_at) if committed else None,
        "observed_at": millis(receipt.observed_at),
    }


def receipt_digest(receipt: authz_pb2.EffectReceipt) -> str:
    return digest(CAPABILITY_RECEIPT, receipt_document(receipt), path="receipt")


def interaction_action_digest(action: Mapping[str, Any]) -> str:
    """The digest a confirmation preview binds to: the action without its grant and lease ids."""
    bound = {key: value for key, value in action.items() if key not in INTERACTION_UNBOUND_KEYS}
    return digest(INTERACTION_ACTION, bound, path="action")


def tool_arguments_digest(arguments: Any) -> str:
    """The ``args_digest`` of a tool call, so that the arguments themselves never leave the caller."""
    return digest(TOOL_ARGUMENTS, arguments, path="arguments")
