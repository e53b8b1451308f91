"""Canonical JSON and the domain-separated digests, against fixed vectors.

The expected bytes are written out by hand below and the expected digests were
computed outside Python (``printf '%s' ... | sha256sum``), so a change to the
implementation cannot move both sides of an assertion at once.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import pytest
from google.protobuf.timestamp_pb2 import Timestamp
from hypothesis import given
from hypothesis import strategies as st

from parley.v1 import authz_pb2
from parley_platform import canonical
from parley_platform.canonical import InvalidContract

AGENT = "6f1f3f3e-6a0c-5b8e-9a57-5061726c6579"
ZERO = "0" * 64
ONES = "1" * 64

# Keys sort by UTF-16 code units: U+1F600 (D83D DE00) before U+FB01, unlike code point order.
VECTOR = {"ﬁ": 3, "b": [1, {"z": None, "a": True}], "😀": 2, "a": 'é\n"x"', "c": -0, "€": 1}
VECTOR_BYTES = (
    b'{"a":"\xc3\xa9\\n\\"x\\"","b":[1,{"a":true,"z":null}],"c":0,'
    b'"\xe2\x82\xac":1,"\xf0\x9f\x98\x80":2,"\xef\xac\x81":3}'
)
VECTOR_SHA256 = "bf5a6cbae18024f664f171c6857382405c23ce0bc1c8e842036c2e8dc318dfce"
VECTOR_ACTION_DIGEST = "2c0e6604c89d63ea4a5fa513950c232b3065bd662cc389f600e6ebc0f4182b30"


def ts(millis: int) -> Timestamp:
    return Timestamp(seconds=millis // 1000, nanos=(millis % 1000) * 1_000_000)


def test_canonical_bytes_of_the_vector() -> None:
    assert canonical.canonical_json(VECTOR) == VECTOR_BYTES
    assert hashlib.sha256(VECTOR_BYTES).hexdigest() == VECTOR_SHA256
    expected = hashlib.sha256(b"parley:interaction-action:v1\n" + VECTOR_BYTES).hexdigest()
    assert expected == VECTOR_ACTION_DIGEST
    assert canonical.digest(canonical.INTERACTION_ACTION, VECTOR) == VECTOR_ACTION_DIGEST


def test_strings_escape_like_jcs() -> None:
    value = {"k": "\x01\x1f\x7f\t\b\f\r\\/\u2028"}
    assert canonical.canonical_json(value) == (b'{"k":"\\u0001\\u001f\x7f\\t\\b\\f\\r\\\\/\xe2\x80\xa8"}')


def test_capability_request_digest_vector() -> None:
    request = authz_pb2.CapabilityRequest(
        version=1,
        agent_id=AGENT,
        account_id="acct-1",
        snapshot_version="v7",
        capability="mail.send",
        operation="create",
        catalog_risk=authz_pb2.RISK_LEVEL_R1,
        risk=authz_pb2.RISK_LEVEL_R2,
        input_digest=ZERO,
        bound_at=ts(1767225600123),
    )
    document = (
        b'{"account_id":"acct-1","agent_id":"' + AGENT.encode() + b'","bound_at":1767225600123,'
        b'"capability":"mail.send","catalog_risk":"R1","input_digest":"' + ZERO.encode() + b'",'
        b'"operation":"create","risk":"R2","snapshot_version":"v7","version":1}'
    )
    assert canonical.canonical_json(canonical.request_document(request)) == document
    expected = "33343bb834f82129ab3485bddbbff7d6ebb6ae2f3c150f54d35d804c932d21f0"
    assert hashlib.sha256(b"parley:capability-request:v1\n" + document).hexdigest() == expected
    assert canonical.request_digest(request) == expected


def test_decision_digest_vector_uses_null_for_fields_the_outcome_does_not_use() -> None:
    decision = authz_pb2.PolicyDecision(
        version=1,
        decision_id="d-1",
        request_digest="33343bb834f82129ab3485bddbbff7d6ebb6ae2f3c150f54d35d804c932d21f0",
        outcome=authz_pb2.POLICY_OUTCOME_CONFIRMATION_REQUIRED,
        confirmation_id="c-1",
        # Not used by confirmation_required: must not reach the document.
        unavailable_code="ignored",
        retryable=True,
        issued_at=ts(1767225601000),
        expires_at=ts(1767225660000),
    )
    assert (
        canonical.decision_digest(decision)
        == "117bbe74ba29375a47c8aa622efe55e0edb7dded5a9282b21e0553476a3541fd"
    )


def test_authorization_id_vector() -> None:
    request_digest = "33343bb834f82129ab3485bddbbff7d6ebb6ae2f3c150f54d35d804c932d21f0"
    assert (
        canonical.authorization_id(AGENT, request_digest, ONES, None)
        == "259fb830cc37801c06f176e2d36b41c6d8b4a7c2bf1887f9a3f2ea5e384a97f3"
    )
    assert canonical.authorization_id(AGENT, request_digest, ONES, ZERO) != canonical.authorization_id(
        AGENT, request_digest, ONES, None
    )


def test_interaction_action_digest_excludes_grant_and_lease_ids() -> None:
    action = {"kind": "click", "target": {"x": 10, "y": 20}, "session_id": "s1"}
    expected = "f40ef4b0c35516e5fa0a7648c6f8184894b7e95f284217dd5fdec6493a77f407"
    assert canonical.interaction_action_digest(action) == expected
    assert canonical.interaction_action_digest({**action, "grant_id": "g-1", "lease_ids": ["l1"]}) == expected
    assert canonical.interaction_action_digest({**action, "target": {"x": 11, "y": 20}}) != expected
    # Only the top level: a nested grant_id is part of the action.
    nested = {**action, "target": {"x": 10, "y": 20, "grant_id": "g"}}
    assert canonical.interaction_action_digest(nested) != expected


def test_tool_arguments_digest_does_not_depend_on_key_order() -> None:
    expected = "b5fd323073e87b27eb4dad985e57e9b796a6e4de5838e03313f07804e2daefc2"
    assert canonical.tool_arguments_digest({"to": "bob@example.com", "n": [1, 2, 3]}) == expected
    assert canonical.tool_arguments_digest({"n": [1, 2, 3], "to": "bob@example.com"}) == expected


@pytest.mark.parametrize(
    ("value", "mentions"),
    [
        ({"amount": 1.5}, "document.amount is a number with a fraction"),
        ({"amount": 1.0}, "document.amount is a number with a fraction"),
        ({"n": 2**53}, "document.n is an integer outside"),
        ({"n": -(2**53)}, "document.n is an integer outside"),
        ({"s": "\ud800"}, "document.s contains a lone surrogate"),
        ({1: "x"}, "document has a key that is not a string"),
        ({"b": b"raw"}, "document.b is a bytes"),
    ],
)
def test_values_outside_the_rules_are_refused(value: Any, mentions: str) -> None:
    with pytest.raises(InvalidContract) as caught:
        canonical.canonical_json(value)
    assert caught.value.code == "INVALID_CONTRACT"
    assert mentions in caught.value.message


def test_nesting_is_bounded() -> None:
    deep: Any = 1
    for _ in range(canonical.MAX_DEPTH + 1):
        deep = [deep]
    with pytest.raises(InvalidContract, match="nested deeper"):
        canonical.canonical_json(deep)


SECRET = "sk-live-0123456789abcdef"


@pytest.mark.parametrize(
    ("text", "mentions"),
    [
        ('{"a": 1, "a": 2}', "duplicate key"),
        ('{"a": 1.25}', "fraction or exponent"),
        ('{"a": 1e3}', "fraction or exponent"),
        ('{"a": NaN}', "NaN or Infinity"),
        ('{"a": -Infinity}', "NaN or Infinity"),
        ('{"a": 9007199254740992}', "integer outside"),
        ('{"a": "\\udc00"}', "lone surrogate"),
        ('{"token": "' + SECRET + '"', "not valid JSON"),
        ("[" * 5000 + "]" * 5000, "nested deeper"),
    ],
)
def test_strict_parse_refuses_and_never_echoes(text: str, mentions: str) -> None:
    with pytest.raises(InvalidContract) as caught:
        canonical.parse_json(text, what="action_json")
    assert mentions in caught.value.message
    assert caught.value.message.startswith("action_json")
    assert SECRET not in str(caught.value)


def test_strict_parse_bounds_the_size() -> None:
    with pytest.raises(InvalidContract, match="longer than 10 bytes"):
        canonical.parse_json('{"k": "0123456789"}', what="action_json", max_bytes=10)


JSON_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-canonical.MAX_SAFE_INTEGER, max_value=canonical.MAX_SAFE_INTEGER)
    | st.text(st.characters(exclude_categories=("Cs",))),
    lambda children: (
        st.lists(children, max_size=4)
        | st.dictionaries(
            st.text(st.characters(exclude_categories=("Cs",)), max_size=6), children, max_size=4
        )
    ),
    max_leaves=20,
)


@given(JSON_VALUES)
def test_canonical_json_round_trips_and_is_a_fixed_point(value: Any) -> None:
    encoded = canonical.canonical_json(value)
    decoded = json.loads(encoded.decode("utf-8"))
    assert decoded == value
    assert canonical.canonical_json(canonical.parse_json(encoded.decode("utf-8"), what="v")) == encoded
    # No insignificant whitespace: re-encoding compactly changes nothing but key order and escapes.
    assert len(encoded) <= len(json.dumps(value, ensure_ascii=False).encode("utf-8"))
