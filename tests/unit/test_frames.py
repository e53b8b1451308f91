"""The RPC envelope (parley_platform.frames): what goes out comes back, and bytes in no envelope
are told apart rather than misread."""

from __future__ import annotations

import time

import pytest

from parley.v1.model_pb2 import GenerateRequest, GenerateResponse
from parley_platform import frames


def test_a_request_round_trips_with_its_deadline_stream_and_batch_flag() -> None:
    body = GenerateRequest(prompt="hello").SerializeToString()
    deadline = time.time() + 5
    parsed = frames.parse_request(frames.request(body, deadline=deadline, stream_id="s-1_A", batch=True))
    assert parsed.body == body
    assert parsed.stream_id == "s-1_A"
    assert parsed.batch
    assert parsed.deadline == pytest.approx(deadline, abs=0.001)

    assert not parsed.last
    both = frames.parse_request(frames.request(body, deadline=None, stream_id="s", batch=True, last=True))
    assert (both.batch, both.last) == (True, True)

    unary = frames.parse_request(frames.request(body, deadline=None))
    assert (unary.deadline, unary.stream_id, unary.body) == (None, "", body)
    assert (unary.batch, unary.last) == (False, False)
    assert frames.parse_request(frames.request(b"", deadline=None)).body == b""


def test_every_status_round_trips() -> None:
    body = GenerateResponse(text="hi").SerializeToString()
    for status in (frames.OK, frames.ERROR, frames.OPEN, frames.ITEMS, frames.END, frames.LAST_ITEMS):
        assert frames.parse_reply(frames.reply(status, body)) == (status, body)
    assert frames.parse_reply(frames.reply(frames.END)) == (frames.END, b"")


@pytest.mark.parametrize(
    ("data", "says"),
    [
        (b"", "shorter"),
        (b"\xb1\x00\x00", "shorter"),
        (GenerateRequest(prompt="a plain request").SerializeToString(), "not in the request envelope"),
        (b"\xb1\x00" + bytes(8) + b"\x05ab", "runs past the end"),
        (b"\xb1\x00" + bytes(8) + b"\x02\xff\xfe", "not ASCII"),
    ],
)
def test_a_request_in_no_envelope_is_refused_with_what_is_wrong(data: bytes, says: str) -> None:
    with pytest.raises(frames.FrameError, match=says):
        frames.parse_request(data)


@pytest.mark.parametrize("data", [b"", b"\x06", GenerateResponse(text="plain").SerializeToString(), b"\xff"])
def test_a_reply_in_no_envelope_is_refused(data: bytes) -> None:
    with pytest.raises(frames.FrameError, match="not in the reply envelope"):
        frames.parse_reply(data)
