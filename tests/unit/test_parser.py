from __future__ import annotations

import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from parley_runtime.parser import (
    MAX_BODY_BYTES,
    MAX_DEPTH,
    MAX_ELEMENTS,
    MAX_INPUT_BYTES,
    ParsedResponse,
    normalize_actions,
    parse_or_plain,
    parse_response,
)

BOUNDED = settings(max_examples=300, deadline=None)


def escape(value: str) -> str:
    return (
        value.replace("&", "&amp;")
        .replace("<", "&lt;")
        .replace(">", "&gt;")
        .replace('"', "&quot;")
        .replace("'", "&apos;")
    )


def parsed(text: str) -> ParsedResponse:
    result = parse_response(text)
    assert result is not None
    return result


def response(body: str) -> str:
    return f"<response>{body}</response>"


# --- the basic shape -------------------------------------------------------------------------------


def test_reads_every_standard_key() -> None:
    result = parsed(
        response(
            "<thought>Bob asked a question</thought>"
            "<actions>REPLY,SEND_MESSAGE</actions>"
            "<providers>TIME, FACTS</providers>"
            "<evaluators>REFLECTION</evaluators>"
            "<text>Hi Bob</text>"
            "<simple>true</simple>"
        )
    )
    assert result == ParsedResponse(
        thought="Bob asked a question",
        actions=["REPLY", "SEND_MESSAGE"],
        action_params={},
        providers=["TIME", "FACTS"],
        evaluators=["REFLECTION"],
        text="Hi Bob",
        simple=True,
        fields={
            "thought": "Bob asked a question",
            "actions": "REPLY,SEND_MESSAGE",
            "providers": "TIME, FACTS",
            "evaluators": "REFLECTION",
            "text": "Hi Bob",
            "simple": "true",
        },
    )


def test_missing_keys_take_defaults() -> None:
    result = parsed(response("<text>hi</text>"))
    assert result == ParsedResponse(text="hi", fields={"text": "hi"})


def test_result_is_frozen() -> None:
    result = parsed(response("<text>hi</text>"))
    with pytest.raises(AttributeError):
        result.text = "changed"  # type: ignore[misc]


def test_defaults_are_not_shared() -> None:
    first, second = ParsedResponse(), ParsedResponse()
    first.actions.append("REPLY")
    assert second.actions == []


def test_unknown_keys_land_in_fields() -> None:
    result = parsed(response("<mood>cheerful</mood><my-key>1</my-key><ns:tag>2</ns:tag><text>hi</text>"))
    assert result.fields == {"mood": "cheerful", "my-key": "1", "ns:tag": "2", "text": "hi"}


def test_values_are_trimmed() -> None:
    result = parsed(response("\n  <thought>\n   deep  thought \t\n</thought>\n  <text>  hi  </text>\n"))
    assert result.thought == "deep  thought"
    assert result.text == "hi"


def test_text_around_the_keys_is_ignored() -> None:
    result = parsed("Sure! Here it is:\n" + response("stray words <text>hi</text> more") + "\nbye")
    assert result.fields == {"text": "hi"}


def test_only_direct_children_are_keys() -> None:
    result = parsed(response("<outer><text>inner</text></outer>"))
    assert result.fields == {"outer": "<text>inner</text>"}
    assert result.text == ""


def test_nested_markup_in_a_value_is_kept_verbatim() -> None:
    assert parsed(response("<text>Hello <b>world</b>!</text>")).text == "Hello <b>world</b>!"


# --- failures ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text",
    [
        "",
        "   \n ",
        "just some words",
        "a < b > c",
        "<response></response>",
        "<response>only text, no keys</response>",
        "<response><simple/><br/></response>",
        "<response><text>unterminated",
        "<response><text>hi</text>",
        "<text>no children</text>",
        "</response><text>",
        "<!-- <response><text>hi</text></response> -->",
    ],
)
def test_returns_none_without_a_usable_block(text: str) -> None:
    assert parse_response(text) is None


# --- entities ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("&lt;y&gt;", "<y>"),
        ("&quot;q&quot; &apos;a&apos; &amp;", "\"q\" 'a' &"),
        ("&amp;lt;", "&lt;"),
        ("&amp;amp;", "&amp;"),
        ("&nbsp; &#60; &LT; &lt", "&nbsp; &#60; &LT; &lt"),
        ("a &lt;b&gt; c", "a <b> c"),
    ],
)
def test_entities_are_unescaped_in_a_single_pass(raw: str, expected: str) -> None:
    result = parsed(response(f"<text>{raw}</text><thought>{raw}</thought>"))
    assert result.text == expected
    assert result.thought == expected
    assert result.fields["text"] == expected


def test_escaped_markup_does_not_become_a_key() -> None:
    result = parsed(response("<text>&lt;actions&gt;STOP&lt;/actions&gt;</text>"))
    assert result.text == "<actions>STOP</actions>"
    assert result.actions == []


def test_cdata_is_literal_text() -> None:
    result = parsed(response("<text>x <![CDATA[a < b &amp; </text> c]]> y</text>"))
    assert result.text == "x a < b &amp; </text> c y"


# --- repeated keys, attributes, skipped constructs ---------------------------------------------------


def test_repeated_key_keeps_the_last_value() -> None:
    result = parsed(
        response("<text>first</text><actions>A</actions><text>second</text><actions>B,C</actions>")
    )
    assert result.text == "second"
    assert result.actions == ["B", "C"]
    assert result.fields == {"text": "second", "actions": "B,C"}


@pytest.mark.parametrize(
    "open_tag",
    [
        '<text lang="en">',
        "<text lang='en'>",
        "<text lang=en>",
        '<text  a="1"\n b="2" >',
        '<text title="a > b">',
        "<text title='say \"hi\"'>",
    ],
)
def test_attributes_are_tolerated(open_tag: str) -> None:
    assert parsed(response(f"{open_tag}hi</text>")).text == "hi"


def test_attributes_on_the_block_are_tolerated() -> None:
    assert parsed('<response version="2"><text>hi</text></response>').text == "hi"


def test_end_tag_may_have_trailing_space() -> None:
    assert parsed(response("<text>hi</text  >")).text == "hi"


def test_comments_are_skipped() -> None:
    result = parsed(response("<!-- <thought>no</thought> --><text>hi <!-- hidden --> there</text>"))
    assert result.fields == {"text": "hi  there"}


def test_processing_instructions_and_declarations_are_skipped() -> None:
    result = parsed(
        '<?xml version="1.0"?><!DOCTYPE response>' + response("<?pi <text>x</text> ?><text>hi</text>")
    )
    assert result.fields == {"text": "hi"}


def test_self_closing_tags_are_skipped() -> None:
    result = parsed(response('<simple/><br /><img src="x"/><text>hi</text>'))
    assert result.fields == {"text": "hi"}
    assert result.simple is False


def test_unmatched_tags_are_skipped() -> None:
    result = parsed(response("<br></stray><thought>t</thought><open><text>hi</text></nothing>"))
    assert result.fields == {"thought": "t", "text": "hi"}


def test_crossing_tags_do_not_hide_later_keys() -> None:
    result = parsed(response("<a><b></a></b><text>hi</text>"))
    assert result.text == "hi"
    assert result.fields["a"] == "<b>"


def test_unterminated_comment_is_text() -> None:
    assert parsed(response("<text>a <!-- b</text>")).text == "a <!-- b"


def test_less_than_in_text_is_literal() -> None:
    assert parsed(response("<text>1 < 2 and 3 <4</text>")).text == "1 < 2 and 3 <4"


# --- choosing the block --------------------------------------------------------------------------


def test_uses_the_first_response_block() -> None:
    text = response("<text>first</text>") + response("<text>second</text>")
    assert parsed(text).text == "first"


def test_response_wins_over_earlier_elements() -> None:
    text = "<think>pondering</think><foo><text>no</text></foo>" + response("<text>yes</text>")
    assert parsed(text).text == "yes"


def test_nested_response_uses_the_outer_block() -> None:
    result = parsed(response("<text>outer</text><response><text>inner</text></response>"))
    assert result.text == "outer"
    assert result.fields["response"] == "<text>inner</text>"


def test_closing_tag_inside_a_comment_does_not_close_the_block() -> None:
    assert parsed(response("<!-- </response> --><text>hi</text>")).text == "hi"


def test_without_response_the_first_balanced_block_is_read() -> None:
    assert parsed("<foo><text>hi</text></foo>").fields == {"text": "hi"}


def test_without_response_later_blocks_are_ignored() -> None:
    assert parsed("<foo><text>hi</text></foo><bar><text>bye</text></bar>").text == "hi"


def test_unclosed_response_falls_back_to_the_first_balanced_block() -> None:
    result = parsed("<response><foo><text>hi</text><actions>REPLY</actions></foo>")
    assert result.text == "hi"
    assert result.actions == ["REPLY"]


def test_fallback_to_a_block_without_keys_is_none() -> None:
    assert parse_response("<response><thought>t</thought><text>hi</text>") is None


def test_unclosed_first_element_is_passed_over() -> None:
    assert parsed("<reply>\n<foo><text>hi</text></foo>").text == "hi"


def test_markdown_fence_around_the_block() -> None:
    assert parsed("```xml\n" + response("<text>hi</text>") + "\n```").text == "hi"


# --- lists -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("REPLY", ["REPLY"]),
        (" REPLY , ,SEND_MESSAGE,, ", ["REPLY", "SEND_MESSAGE"]),
        ("", []),
        (" , ,, ", []),
        ("a,\nb,\tc", ["a", "b", "c"]),
    ],
)
def test_comma_lists_are_trimmed_without_empties(raw: str, expected: list[str]) -> None:
    result = parsed(
        response(f"<actions>{raw}</actions><providers>{raw}</providers><evaluators>{raw}</evaluators>")
    )
    assert result.actions == expected
    assert result.providers == expected
    assert result.evaluators == expected


def test_absent_lists_are_empty() -> None:
    result = parsed(response("<text>hi</text>"))
    assert (result.actions, result.providers, result.evaluators) == ([], [], [])


# --- structured actions and params ------------------------------------------------------------------


def test_nested_actions_give_names_and_params() -> None:
    result = parsed(
        response(
            "<actions>"
            "<action><name>SEND_MESSAGE</name><params><to>bob</to><text>hi</text></params></action>"
            "<action><name> REPLY </name></action>"
            "</actions>"
        )
    )
    assert result.actions == ["SEND_MESSAGE", "REPLY"]
    assert result.action_params == {"SEND_MESSAGE": {"to": "bob", "text": "hi"}}


def test_nested_action_param_values_are_unescaped_and_trimmed() -> None:
    result = parsed(
        response(
            "<actions><action><name>X</name><params><q> a &amp;&lt;b&gt; </q></params></action></actions>"
        )
    )
    assert result.action_params == {"X": {"q": "a &<b>"}}


def test_nested_action_name_from_attribute_or_text() -> None:
    result = parsed(
        response(
            '<actions><action name="SEND"><params><to>bob</to></params></action>'
            "<action>REPLY</action></actions>"
        )
    )
    assert result.actions == ["SEND", "REPLY"]
    assert result.action_params == {"SEND": {"to": "bob"}}


def test_nested_action_without_a_name_is_dropped() -> None:
    result = parsed(
        response("<actions><action><params><to>bob</to></params></action></actions><text>t</text>")
    )
    assert result.actions == []
    assert result.action_params == {}


def test_nested_actions_ignore_other_children() -> None:
    result = parsed(response("<actions>NOISE, <note>x</note><action>REPLY</action></actions>"))
    assert result.actions == ["REPLY"]


def test_params_may_be_a_json_object() -> None:
    result = parsed(
        response(
            '<actions><action><name>X</name><params>{"n": 1, "to": "bob", "html": "<b>hi</b>"}</params>'
            "</action></actions>"
        )
    )
    assert result.action_params == {"X": {"n": 1, "to": "bob", "html": "<b>hi</b>"}}


def test_params_json_may_be_escaped() -> None:
    result = parsed(
        response("<actions><action><name>X</name><params>{&quot;to&quot;: 1}</params></action></actions>")
    )
    assert result.action_params == {"X": {"to": 1}}


@pytest.mark.parametrize("content", ["[1, 2]", "{not json", '"str"', "42", "{" * 5000 + "}" * 5000, ""])
def test_params_that_are_not_a_json_object_are_empty(content: str) -> None:
    result = parsed(response(f"<actions><action><name>X</name><params>{content}</params></action></actions>"))
    assert result.actions == ["X"]
    assert result.action_params == {}


def test_top_level_params_are_keyed_by_action() -> None:
    result = parsed(
        response(
            "<actions>SEND_MESSAGE, REPLY</actions>"
            "<params><SEND_MESSAGE><to>bob</to><text> hi &amp; bye </text></SEND_MESSAGE>"
            "<REPLY><tone>warm</tone></REPLY></params>"
        )
    )
    assert result.actions == ["SEND_MESSAGE", "REPLY"]
    assert result.action_params == {
        "SEND_MESSAGE": {"to": "bob", "text": "hi & bye"},
        "REPLY": {"tone": "warm"},
    }


def test_top_level_params_may_be_json() -> None:
    result = parsed(response('<actions>A</actions><params>{"A": {"x": "1"}, "B": 2}</params>'))
    assert result.action_params == {"A": {"x": "1"}}


def test_nested_params_win_over_top_level_params() -> None:
    result = parsed(
        response(
            "<actions><action><name>SEND</name><params><to>bob</to></params></action></actions>"
            "<params><SEND><to>alice</to><cc>carol</cc></SEND><OTHER><x>1</x></OTHER></params>"
        )
    )
    assert result.action_params == {"SEND": {"to": "bob", "cc": "carol"}, "OTHER": {"x": "1"}}


def test_repeated_param_keeps_the_last_value() -> None:
    result = parsed(
        response("<actions><action><name>X</name><params><a>1</a><a>2</a></params></action></actions>")
    )
    assert result.action_params == {"X": {"a": "2"}}


# --- simple ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("true", True),
        ("TRUE", True),
        (" Yes ", True),
        ("1", True),
        ("false", False),
        ("no", False),
        ("0", False),
        ("", False),
        ("maybe", False),
        ("truest", False),
    ],
)
def test_simple_is_a_boolean(raw: str, expected: bool) -> None:
    assert parsed(response(f"<simple>{raw}</simple>")).simple is expected


# --- limits ------------------------------------------------------------------------------------------


def test_limit_constants() -> None:
    assert (MAX_INPUT_BYTES, MAX_BODY_BYTES, MAX_ELEMENTS, MAX_DEPTH) == (1_048_576, 262_144, 64, 32)


def padded_to(size: int, filler: str = " ") -> str:
    doc = response("<text>hi</text>")
    pad = size - len(doc.encode())
    assert pad % len(filler.encode()) == 0
    return doc + filler * (pad // len(filler.encode()))


def test_input_at_the_limit_is_parsed() -> None:
    assert parsed(padded_to(MAX_INPUT_BYTES)).text == "hi"


def test_input_over_the_limit_is_none() -> None:
    assert parse_response(padded_to(MAX_INPUT_BYTES + 1)) is None


def test_input_limit_counts_utf8_bytes() -> None:
    at_limit = padded_to(MAX_INPUT_BYTES, "é")
    assert len(at_limit) < MAX_INPUT_BYTES
    assert parsed(at_limit).text == "hi"
    over = padded_to(MAX_INPUT_BYTES + 2, "é")
    assert len(over) < MAX_INPUT_BYTES
    assert parse_response(over) is None


def body_of(size: int, filler: str = "x") -> str:
    overhead = len("<text></text>")
    count, rest = divmod(size - overhead, len(filler.encode()))
    assert rest == 0
    body = f"<text>{filler * count}</text>"
    assert len(body.encode()) == size
    return body


def test_body_at_the_limit_is_parsed() -> None:
    result = parsed(response(body_of(MAX_BODY_BYTES)))
    assert len(result.text) == MAX_BODY_BYTES - len("<text></text>")


def test_body_over_the_limit_is_none() -> None:
    assert parse_response(response(body_of(MAX_BODY_BYTES + 1))) is None


def test_body_limit_counts_utf8_bytes() -> None:
    assert parsed(response(body_of(MAX_BODY_BYTES - 1, "é"))).text
    over = body_of(MAX_BODY_BYTES + 1, "é")
    assert len(over) < MAX_BODY_BYTES
    assert parse_response(response(over)) is None


def test_body_limit_applies_to_the_fallback_block() -> None:
    assert parsed("<foo>" + body_of(MAX_BODY_BYTES) + "</foo>").text
    assert parse_response("<foo>" + body_of(MAX_BODY_BYTES + 1) + "</foo>") is None


def siblings(count: int) -> str:
    return response("".join(f"<k{i}>v</k{i}>" for i in range(count)))


def test_elements_at_the_limit_are_parsed() -> None:
    assert len(parsed(siblings(MAX_ELEMENTS)).fields) == MAX_ELEMENTS


def test_elements_over_the_limit_are_none() -> None:
    assert parse_response(siblings(MAX_ELEMENTS + 1)) is None


def test_element_limit_counts_nested_self_closing_and_unmatched_tags() -> None:
    def doc(extra: int, tag: str) -> str:
        return response("<text>hi</text><outer>" + tag * extra + "</outer>")

    for tag in ("<b>x</b>", "<br/>", "<open>"):
        assert parsed(doc(MAX_ELEMENTS - 2, tag)).text == "hi"
        assert parse_response(doc(MAX_ELEMENTS - 1, tag)) is None


def nested(depth: int) -> str:
    names = [f"d{i}" for i in range(depth)]
    return response("".join(f"<{n}>" for n in names) + "deep" + "".join(f"</{n}>" for n in reversed(names)))


def test_depth_at_the_limit_is_parsed() -> None:
    result = parsed(nested(MAX_DEPTH))
    assert list(result.fields) == ["d0"]
    assert f"<d{MAX_DEPTH - 1}>deep</d{MAX_DEPTH - 1}>" in result.fields["d0"]


def test_depth_over_the_limit_is_none() -> None:
    assert parse_response(nested(MAX_DEPTH + 1)) is None


def test_depth_counts_only_matched_elements() -> None:
    assert parsed(response("<text>hi</text>" + "<open>" * (MAX_DEPTH + 1))).text == "hi"


def test_limits_inside_the_block_only() -> None:
    noise = "<n>" * 1000 + "</n>" * 1000
    assert parsed(noise + response("<text>hi</text>") + noise).text == "hi"


ADVERSARIAL = {
    "open tags": "<a>" * (MAX_INPUT_BYTES // 3),
    "balanced pairs": "<response>" + "<b></b>" * ((MAX_INPUT_BYTES - 10) // 7),
    "end tags": "</a>" * (MAX_INPUT_BYTES // 4),
    "self closing": "<a/>" * (MAX_INPUT_BYTES // 4),
    "lone brackets": "<" * MAX_INPUT_BYTES,
    "unterminated comments": "<!--" * (MAX_INPUT_BYTES // 4),
    "unterminated cdata": "<![CDATA[" * (MAX_INPUT_BYTES // 9),
    "unterminated pis": "<?" * (MAX_INPUT_BYTES // 2),
    "unterminated quotes": '<a "' * (MAX_INPUT_BYTES // 4),
    "many attributes": "<a " + 'x="1" ' * ((MAX_INPUT_BYTES - 4) // 6) + ">",
    "crossing": "<a><b>" * (MAX_INPUT_BYTES // 6),
    "text with brackets": "<a>" + "x<" * ((MAX_INPUT_BYTES - 7) // 2) + "</a>",
    "entities": response("<text>" + "&amp;" * ((MAX_INPUT_BYTES - 40) // 5) + "</text>"),
    "deep unclosed": "<response>" + "<a>" * ((MAX_INPUT_BYTES - 10) // 3),
    "long name": "<" + "a" * (MAX_INPUT_BYTES - 1),
    "spaces in end tag": "</a" + " " * (MAX_INPUT_BYTES - 3),
}


@pytest.mark.parametrize("text", ADVERSARIAL.values(), ids=ADVERSARIAL.keys())
def test_a_mebibyte_of_hostile_input_is_fast(text: str) -> None:
    assert len(text.encode()) <= MAX_INPUT_BYTES
    started = time.process_time()
    result = parse_response(text)
    assert time.process_time() - started < 1.0
    assert result is None or isinstance(result, ParsedResponse)


# --- normalize_actions -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("actions", "text", "expected"),
    [
        ([], "hi", ["IGNORE"]),
        ([], "", ["IGNORE"]),
        (["IGNORE", "REPLY"], "hello", ["REPLY"]),
        (["REPLY", "IGNORE"], "", ["IGNORE"]),
        (["REPLY", "IGNORE"], "  \n", ["IGNORE"]),
        (["IGNORE"], "hello", ["IGNORE"]),
        (["IGNORE", "IGNORE"], "hello", ["IGNORE"]),
        (["REPLY", "STOP"], "hello", ["REPLY"]),
        (["STOP", "REPLY", "SEND"], "", ["REPLY", "SEND"]),
        (["STOP"], "", ["STOP"]),
        (["ignore", "Reply", "stop"], "hi", ["REPLY"]),
        (["reply", "send_message"], "hi", ["REPLY", "SEND_MESSAGE"]),
        (["IGNORE", "STOP"], "hi", ["STOP"]),
        (["IGNORE", "STOP"], "", ["IGNORE"]),
        (["REPLY", "REPLY"], "hi", ["REPLY", "REPLY"]),
    ],
)
def test_normalize_actions(actions: list[str], text: str, expected: list[str]) -> None:
    assert normalize_actions(ParsedResponse(actions=actions, text=text)) == expected


def test_normalize_parsed_examples() -> None:
    assert normalize_actions(parsed(response("<actions>IGNORE,REPLY</actions><text>hi</text>"))) == ["REPLY"]
    assert normalize_actions(parsed(response("<actions>REPLY,IGNORE</actions><text></text>"))) == ["IGNORE"]
    assert normalize_actions(parsed(response("<actions></actions><text>hi</text>"))) == ["IGNORE"]


# --- parse_or_plain ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("  Hello there!\n", "Hello there!"),
        ("1 < 2, and 3 <= 4 > 0", "1 < 2, and 3 <= 4 > 0"),
        ("<3 you", "<3 you"),
        ("a < b", "a < b"),
    ],
)
def test_plain_text_becomes_a_reply(text: str, expected: str) -> None:
    result = parse_or_plain(text)
    assert result == ParsedResponse(actions=["REPLY"], text=expected)
    assert normalize_actions(result) == ["REPLY"]


@pytest.mark.parametrize("text", ["", "  \n\t", "<b>broken", "x <response><text>hi", "<foo>", "</end>x<a"])
def test_unparsable_markup_or_nothing_becomes_ignore(text: str) -> None:
    result = parse_or_plain(text)
    assert result == ParsedResponse()
    assert normalize_actions(result) == ["IGNORE"]


def test_parse_or_plain_passes_parsed_responses_through() -> None:
    text = response("<actions>SEND</actions><text>hi</text>")
    assert parse_or_plain(text) == parse_response(text)


def test_plain_text_is_capped_to_the_body_limit() -> None:
    assert parse_or_plain("x" * (MAX_BODY_BYTES + 10)).text == "x" * MAX_BODY_BYTES
    capped = parse_or_plain("é" * MAX_BODY_BYTES).text
    assert capped == "é" * (MAX_BODY_BYTES // 2)
    odd = parse_or_plain("a" + "é" * MAX_BODY_BYTES).text
    assert len(odd.encode()) == MAX_BODY_BYTES - 1
    assert odd == "a" + "é" * (MAX_BODY_BYTES // 2 - 1)


def test_plain_text_over_the_input_limit_is_still_a_capped_reply() -> None:
    result = parse_or_plain("word " * MAX_INPUT_BYTES)
    assert result.actions == ["REPLY"]
    assert len(result.text.encode()) <= MAX_BODY_BYTES
    assert result.text.startswith("word word")


# --- properties --------------------------------------------------------------------------------------

NAMES = st.sampled_from(["response", "text", "thought", "actions", "action", "name", "params", "simple", "a"])
ATTRIBUTES = st.sampled_from(["", ' x="1"', " x='>'", ' name="REPLY"', " x", ' x="<"', "/"])
NOISE = st.sampled_from(
    [
        "&lt;",
        "&gt;",
        "&amp;",
        "&quot;",
        "&apos;",
        "&amp;lt;",
        "&",
        "&lt",
        "<!-- c -->",
        "<!--",
        "-->",
        "<?pi?>",
        "<?",
        "?>",
        "<![CDATA[x<y]]>",
        "<![CDATA[",
        "]]>",
        "<br/>",
        "</stray>",
        "<open>",
        "<",
        ">",
        "</",
        "<a",
        "/>",
        "<!DOCTYPE x>",
        ",",
        " , ",
        '{"a": 1}',
    ]
)
LEAVES = st.one_of(st.text(alphabet="ab <>&;/!?-[]\"'=,{} \n", max_size=8), NOISE)
MARKUP = st.recursive(
    LEAVES,
    lambda children: st.one_of(
        st.builds(
            lambda name, attrs, kids, close: (
                f"<{name}{attrs}>{''.join(kids)}" + (f"</{name}>" if close else "")
            ),
            NAMES,
            ATTRIBUTES,
            st.lists(children, max_size=4),
            st.booleans(),
        ),
        st.lists(children, max_size=4).map("".join),
    ),
    max_leaves=40,
)


def check_total(text: str) -> None:
    result = parse_response(text)
    assert result is None or isinstance(result, ParsedResponse)
    if result is not None:
        assert result.fields
        assert all(value == value.strip() for value in result.fields.values())
        assert all(
            name and name == name.strip() for name in result.actions + result.providers + result.evaluators
        )
    fallback = parse_or_plain(text)
    assert isinstance(fallback, ParsedResponse)
    normalized = normalize_actions(fallback)
    assert normalized
    assert all(name == name.upper() for name in normalized)


@pytest.mark.parametrize(
    "text",
    [
        "\ud800",
        "<response><text>\udfff</text></response>",
        "\ud800" * (MAX_BODY_BYTES // 2),
        "<response><text>" + "\ud800" * (MAX_BODY_BYTES // 2) + "</text></response>",
    ],
)
def test_lone_surrogates_do_not_raise(text: str) -> None:
    check_total(text)
    assert normalize_actions(parse_or_plain(text))


@BOUNDED
@given(st.text())
def test_never_raises_on_arbitrary_text(text: str) -> None:
    check_total(text)


@BOUNDED
@given(MARKUP, st.booleans())
def test_never_raises_on_markup(markup: str, wrap: bool) -> None:
    check_total(response(markup) if wrap else markup)


@BOUNDED
@given(thought=st.text(), actions=st.text(), text=st.text())
def test_escaped_values_round_trip(thought: str, actions: str, text: str) -> None:
    doc = response(
        f"<thought>{escape(thought)}</thought><actions>{escape(actions)}</actions><text>{escape(text)}</text>"
    )
    result = parsed(doc)
    assert result.thought == thought.strip()
    assert result.text == text.strip()
    assert result.fields["actions"] == actions.strip()
    assert result.actions == [item.strip() for item in actions.split(",") if item.strip()]


ACTION_NAMES = st.from_regex(r"[A-Z][A-Z0-9_]{0,15}", fullmatch=True)


@BOUNDED
@given(names=st.lists(ACTION_NAMES, max_size=12), separator=st.sampled_from([", ", ",", " ,  ", ",\n"]))
def test_action_lists_round_trip(names: list[str], separator: str) -> None:
    joined = separator.join(names)
    result = parsed(
        response(
            f"<actions>{joined}</actions><providers>{joined}</providers><evaluators>{joined}</evaluators>"
        )
    )
    assert result.actions == names
    assert result.providers == names
    assert result.evaluators == names


@BOUNDED
@given(names=st.lists(ACTION_NAMES, min_size=1, max_size=8), has_text=st.booleans())
def test_normalized_actions_are_upper_case_and_never_empty(names: list[str], has_text: bool) -> None:
    result = normalize_actions(ParsedResponse(actions=names, text="hi" if has_text else ""))
    assert result
    assert all(name == name.upper() for name in result)
    if len(result) > 1:
        assert "IGNORE" not in result
        assert "STOP" not in result


@settings(max_examples=60, deadline=None)
@given(count=st.integers(min_value=1, max_value=MAX_ELEMENTS + 8))
def test_sibling_count_limit(count: int) -> None:
    assert (parse_response(siblings(count)) is None) == (count > MAX_ELEMENTS)


@settings(max_examples=40, deadline=None)
@given(depth=st.integers(min_value=1, max_value=MAX_DEPTH + 8))
def test_depth_limit(depth: int) -> None:
    assert (parse_response(nested(depth)) is None) == (depth > MAX_DEPTH)
