"""The pure parts of documents (knowledge): reading what was given, and cutting it into fragments."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from parley.v1 import documents_pb2
from parley_platform.errors import InvalidArgument
from parley_runtime.documents.api import requester_of
from parley_runtime.documents.domain import (
    MARKDOWN,
    PDF,
    PLAIN,
    chunk,
    content_type_of,
    extract,
    grants_of,
    search_limit,
)


def test_chunking_keeps_fragments_bounded_and_headed() -> None:
    long = "word " * 3000
    fragments = chunk(long, PLAIN, size=500)
    assert all(len(f) <= 500 for f in fragments)
    assert " ".join(fragments).split() == long.split()
    sections = chunk("# A\n\nfirst\n\n# B\n\n" + "x " * 700, MARKDOWN, size=400)
    assert sections[0] == "A\nfirst"
    assert all(s.startswith("B\n") for s in sections[1:])
    assert len(sections) >= 3


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet=st.sampled_from("ab \n#.!"), max_size=3000), st.integers(min_value=20, max_value=400))
def test_fragments_never_exceed_their_size_and_lose_no_words(text: str, size: int) -> None:
    fragments = chunk(text, PLAIN, size=size)
    assert all(0 < len(f) <= size for f in fragments)
    assert " ".join(fragments).split() == text.split()


def test_what_was_given_is_read_by_its_type() -> None:
    assert extract("", "héllo".encode(), "", "a.txt") == ("héllo", PLAIN, 6)
    assert extract("# T", b"", "", "") == ("# T", PLAIN, 3)
    assert extract("", b"# T", "", "notes.MD")[1] == MARKDOWN
    assert content_type_of("application/pdf; charset=binary", "") == PDF
    cases = [
        (("text", b"bytes", "", ""), "DOCUMENT_CONTENT_REQUIRED"),
        (("", b"", "", ""), "DOCUMENT_CONTENT_REQUIRED"),
        (("", b"\xff\xfe\xfa", "", "a.txt"), "DOCUMENT_NOT_UTF8"),
        (("", b"x", "", "a.docx"), "UNSUPPORTED_CONTENT_TYPE"),
        (("", b"%PDF-1.4 truncated", "", "a.pdf"), "PDF_UNREADABLE"),
        (("   \n ", b"", "", ""), "DOCUMENT_EMPTY"),
    ]
    for args, code in cases:
        with pytest.raises(InvalidArgument) as refused:
            extract(*args)
        assert refused.value.code == code


def test_requests_are_validated_before_any_read() -> None:
    with pytest.raises(InvalidArgument):
        requester_of(documents_pb2.Requester())
    with pytest.raises(InvalidArgument):
        requester_of(documents_pb2.Requester(operator=True, entity_id="00000000-0000-0000-0000-000000000001"))
    assert requester_of(documents_pb2.Requester(operator=True)).operator
    one = "00000000-0000-0000-0000-000000000001"
    assert len(grants_of([one])) == 1
    for bad in ([one, one], ["x"], [f"00000000-0000-0000-0000-{i:012d}" for i in range(1001)]):
        with pytest.raises(InvalidArgument):
            grants_of(bad)
    assert search_limit(0) == 10
    for bad_limit in (-1, 101):
        with pytest.raises(InvalidArgument):
            search_limit(bad_limit)
