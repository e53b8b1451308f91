"""JSON read from PostgreSQL goes through orjson for speed (``parley_platform.postgres._json_loads``),
and must read every document exactly as the standard library's json did."""

from __future__ import annotations

import json
import math
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from parley_platform.postgres import _json_loads

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(10**30), max_value=10**30)
    | st.sampled_from([-(2**63) - 1, -(2**63), 2**63 - 1, 2**63, 2**64 - 1, 2**64])
    | st.floats(allow_nan=False)
    | st.text(),
    lambda children: st.lists(children, max_size=5) | st.dictionaries(st.text(), children, max_size=5),
    max_leaves=30,
)


def same(a: Any, b: Any) -> bool:
    """Equal, with the type of every number too (1 and 1.0 are not the same reading)."""
    if isinstance(a, float) and isinstance(b, float):
        return a == b and math.copysign(1, a) == math.copysign(1, b)
    if type(a) is not type(b):
        return False
    if isinstance(a, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return bool(a == b)


@settings(max_examples=300)
@given(json_values)
def test_any_document_reads_as_json_reads_it(value: Any) -> None:
    text = json.dumps(value)
    assert same(_json_loads(text.encode()), json.loads(text))
    assert same(_json_loads(text), json.loads(text))


def test_numbers_where_orjson_alone_would_differ() -> None:
    # Beyond 64 bits (orjson alone: a float), the 64-bit limits, and beyond a double (orjson alone:
    # an error; jsonb's numbers are numeric and can hold them).
    for text in (
        '{"big": 123456789012345678901234567890}',
        "[18446744073709551615, 18446744073709551616, -9223372036854775809]",
        "[-9223372036854775808, -9223372036854775809, -9999999999999999999, -10000000000000000000]",
        '{"n": -9223372036854775809}',
        "[1e400, -1e400, 1.5e-320, -0.0]",
        '{"a": 1, "a": 2}',
    ):
        assert same(_json_loads(text.encode()), json.loads(text)), text
