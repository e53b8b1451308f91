"""The web service's pure parts: the room it reads a user's history from is the runtime's room, a
reply is passed on in order whatever the order its chunks arrive in, and a request body is checked
field by field."""

from __future__ import annotations

import uuid

import pytest
from hypothesis import given
from hypothesis import strategies as st

from parley_connectors import Chunk
from parley_platform.errors import ParleyError
from parley_runtime import ids
from parley_web.access import Caller, room_id
from parley_web.relay import Delta, Done, Waiter
from parley_web.routes import parse_request


def test_the_history_room_is_the_runtimes_room() -> None:
    agent = uuid.uuid4()
    channel = Caller("site", str(agent)).sender("ann")
    assert room_id(str(agent), channel) == str(ids.room_id(agent, "web", channel))


def test_each_key_and_user_names_its_own_sender() -> None:
    caller = Caller("site", str(uuid.uuid4()))
    assert caller.sender("ann") != caller.sender("bob")
    assert caller.sender("") == caller.sender("default")
    assert Caller("other", caller.agent_id).sender("ann") != caller.sender("ann")


def chunk(sequence: int, delta: str, final: bool = False, outcome: str = "") -> Chunk:
    return Chunk("a", "web", "t", "r", "c", "m", sequence, delta, final, outcome)


def drain(waiter: Waiter) -> list[Delta | Done]:
    events = []
    while not waiter.queue.empty():
        events.append(waiter.queue.get_nowait())
    return events


@given(st.lists(st.text(min_size=1, max_size=5), min_size=1, max_size=8), st.randoms())
def test_chunks_in_any_order_give_the_text_in_order(pieces: list[str], rng: object) -> None:
    waiter = Waiter()
    chunks = [chunk(i + 1, piece) for i, piece in enumerate(pieces)]
    rng.shuffle(chunks)  # type: ignore[attr-defined]
    for c in chunks + chunks[:2]:  # and a repeat or two
        waiter.chunk(c)
    text = "".join(pieces)
    waiter.done(text)
    events = drain(waiter)
    assert "".join(e.text for e in events if isinstance(e, Delta)) == text
    assert events[-1] == Done(text)


def test_what_did_not_stream_comes_before_the_end() -> None:
    waiter = Waiter()
    waiter.chunk(chunk(1, "Hello"))
    waiter.chunk(chunk(3, "lost in between"))  # 2 never came
    waiter.done("Hello, world")
    assert drain(waiter) == [Delta("Hello"), Delta(", world"), Done("Hello, world")]


def test_a_superseded_turn_ends_without_a_reply() -> None:
    waiter = Waiter()
    waiter.chunk(chunk(1, "Hel"))
    waiter.chunk(chunk(2, "", final=True, outcome="superseded"))
    assert drain(waiter) == [Delta("Hel"), Done("", "superseded")]


def test_a_request_body_is_read() -> None:
    body = {
        "model": "default",
        "messages": [
            {"role": "user", "content": "first"},
            {"role": "assistant", "content": "ok"},
            {"role": "user", "content": [{"type": "text", "text": "sec"}, {"type": "text", "text": "ond"}]},
        ],
        "stream": True,
        "user": "ann",
        "temperature": 0.2,
    }
    assert parse_request(body, 100) == ("default", "second", True, "ann")


@pytest.mark.parametrize(
    ("body", "says"),
    [
        ({"model": "m", "messages": [{"role": "user", "content": "x" * 11}]}, "longer than 10"),
        ({"model": "m", "messages": [{"role": "user", "content": "  "}]}, "empty"),
        ({"model": "m", "messages": [{"role": "user", "content": "x"}], "user": 5}, "user must be"),
        ({"model": "m", "messages": ["x"]}, "message objects"),
        ({"model": "", "messages": [{"role": "user", "content": "x"}]}, "model is required"),
    ],
)
def test_a_bad_body_says_what_is_wrong(body: dict[str, object], says: str) -> None:
    with pytest.raises(ParleyError) as caught:
        parse_request(body, 10)
    assert caught.value.code == "INVALID_REQUEST"
    assert says in caught.value.message
