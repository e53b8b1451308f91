"""The incremental ``<response>`` parser of streamed replies (``parley_runtime.turn.textstream``).

Model outputs are generated from the contract's grammar (elements in any order, entities, CDATA,
comments, inline markup, stray ``<`` and ``&``, whitespace, secrets) and fed split at every
position: what streams is always the beginning of the reply the full parser finds, all of it once
the text is closed, and never a thought, a contract tag or an action name.
"""

from __future__ import annotations

from hypothesis import example, given, settings
from hypothesis import strategies as st

from parley_runtime.parser import parse_or_plain
from parley_runtime.secrets import Redactor
from parley_runtime.turn.textstream import TextStream

SECRET = "sk-live-0123"
REDACTOR = Redactor([SECRET, "hunter22"])
THOUGHT = "QQTHOUGHTQQ"
ACTION_NAMES = ("REPLY", "IGNORE", "SEND_MESSAGE", "MUTE_ROOM")
CONTRACT_TAGS = (
    "<response",
    "</response",
    "<thought",
    "</thought",
    "<actions",
    "</actions",
    "<text",
    "</text",
)

words = st.text(alphabet="abcdefghij klm,.!?0123456789\n\t", min_size=1, max_size=12)
text_piece = st.one_of(
    words,
    st.sampled_from(["&amp;", "&lt;", "&gt;", "&quot;", "&apos;", "&amp;lt;", "& ", "&nbsp;", "&", ";"]),
    st.sampled_from(["< 3", "a < b", "<3", "<<", "x<y", "1 <= 2", ">"]),
    words.map(lambda w: f"<![CDATA[{w} <b> & ]]>"),
    words.map(lambda w: f"<!--{w} <text> -->"),
    words.map(lambda w: f"<b>{w}</b>"),
    st.just("<br/>"),
    st.just("<?pi x?>"),
    st.just(SECRET),
    st.just("hunter22"),
    st.sampled_from(["  ", "\n", " \t "]),
)
text_body = st.lists(text_piece, max_size=12).map("".join)


@st.composite
def outputs(draw: st.DrawFn) -> str:
    actions = draw(st.lists(st.sampled_from(ACTION_NAMES), min_size=1, max_size=3))
    elements = {
        "thought": f"<thought>{THOUGHT} {draw(words)} &lt;text&gt;</thought>",
        "actions": f"<actions>{', '.join(actions)}</actions>",
        "text": f"<text>{draw(text_body)}</text>",
    }
    if draw(st.booleans()):
        elements["providers"] = (
            f"<providers>{draw(st.sampled_from(['', ' ', 'FACTS', 'TIME, FACTS']))}</providers>"
        )
    order = draw(st.permutations(sorted(elements)))
    gap = st.sampled_from(["", "\n", "  ", "\n  "])
    inner = "".join(draw(gap) + elements[name] for name in order) + draw(gap)
    before = draw(st.sampled_from(["", "Sure!\n", "```xml\n", "<think>hmm</think>\n"]))
    after = draw(st.sampled_from(["", "\n", "\n```", " trailing words"]))
    return f"{before}<response>{inner}</response>{after}"


def final_text(output: str) -> str:
    """The reply's text as the turn stores and publishes it (REPLY's text, stripped, redacted)."""
    return REDACTOR.redact(parse_or_plain(output).text.strip())


def streams_whole_text(output: str) -> bool:
    """When the text is streamed as it comes: actions first (starting with REPLY), providers empty."""
    parsed = parse_or_plain(output)
    at = output.index
    before_text = [
        name for name in ("actions", "providers") if f"<{name}>" in output and at(f"<{name}>") < at("<text>")
    ]
    return (
        "actions" in before_text
        and [a.strip().upper() for a in parsed.actions if a.strip() and a.strip().upper() != "IGNORE"][:1]
        == ["REPLY"]
        and not parsed.providers
    )


def feed(output: str, cuts: list[int]) -> str:
    stream = TextStream(REDACTOR)
    at, released = 0, []
    for cut in [*sorted(cuts), len(output)]:
        released.append(stream.feed(output[at:cut]))
        at = cut
    return "".join(released)


def assert_no_leak(streamed: str) -> None:
    assert THOUGHT not in streamed
    assert SECRET not in streamed
    assert not any(tag in streamed for tag in CONTRACT_TAGS)
    assert not any(name in streamed for name in ACTION_NAMES)


@settings(max_examples=250, deadline=None)
@given(outputs())
@example("<response><actions>REPLY</actions><text>Hi &amp; bye</text></response>")
@example("<response><thought>x</thought><actions>REPLY</actions><text> a < b </text></response>")
def test_split_at_every_position_streams_the_reply_and_nothing_else(output: str) -> None:
    final = final_text(output)
    whole = streams_whole_text(output)
    for cut in range(len(output) + 1):
        streamed = feed(output, [cut])
        assert final.startswith(streamed), (cut, streamed, final)
        assert_no_leak(streamed)
        if whole:
            assert streamed == final, (cut, streamed, final)
    one_by_one = feed(output, list(range(len(output))))
    assert one_by_one == (final if whole else one_by_one)
    assert final.startswith(one_by_one)


@settings(max_examples=200, deadline=None)
@given(outputs(), st.lists(st.integers(min_value=0, max_value=400), max_size=20))
def test_any_chunking_releases_the_same_text(output: str, cuts: list[int]) -> None:
    cuts = [c for c in cuts if c <= len(output)]
    assert feed(output, cuts) == feed(output, [])


@settings(max_examples=300, deadline=None)
@given(
    st.text(alphabet="<>/&;!-[]?CDATxtesponaciREPLY \n", max_size=120),
    st.lists(st.integers(min_value=0, max_value=120), max_size=10),
)
def test_arbitrary_output_is_chunking_independent_and_never_leaks_tags(output: str, cuts: list[int]) -> None:
    streamed = feed(output, [c for c in cuts if c <= len(output)])
    assert streamed == feed(output, [])
    assert "<response" not in streamed
    assert "</text" not in streamed


def test_plain_answers_and_late_actions_wait_for_the_whole_reply() -> None:
    plain = TextStream()
    assert plain.feed("Just talking, no contract.") == ""
    assert plain.finish("Just talking, no contract.") == "Just talking, no contract."
    late = TextStream()
    assert late.feed("<response><text>Hello there</text><actions>REPLY</actions></response>") == ""
    ignored = TextStream()
    assert ignored.feed("<response><actions>IGNORE</actions><text>not said</text></response>") == ""
    asks_again = TextStream()
    assert (
        asks_again.feed("<response><actions>REPLY</actions><providers>FACTS</providers><text>x y</text>")
        == ""
    )


def test_a_secret_split_across_chunks_never_streams() -> None:
    stream = TextStream(REDACTOR)
    out = [
        stream.feed(p) for p in ("<response><actions>REPLY</actions><text>key sk-li", "ve-01", "23 ok</text>")
    ]
    assert "".join(out) == "key [REDACTED] ok"
    assert SECRET[:5] not in out[0]


def test_finish_gives_the_rest_or_says_the_reply_differs() -> None:
    stream = TextStream()
    assert stream.feed("<response><actions>REPLY</actions><text>Hello wor") == "Hello wor"
    assert stream.feed("ld  ") == "ld"  # the spaces wait: they may end the text
    assert stream.finish("Hello world") == ""
    assert stream.finish("Hello world!") == "!"
    other = TextStream()
    other.feed("<response><actions>REPLY</actions><text>Hello wor")
    assert other.finish("Goodbye") is None
