"""The gateway's pure logic: the PROMPT_BATCHER_* knobs (table-driven), the token-limit formula, packing,
the packed prompt and its answer, the response grammar and its repair, the breaker, the backoff,
segment ordering and Anthropic cache markers."""

from __future__ import annotations

import hashlib
import math
import random
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from parley_gateway.batching import (
    BatcherConfig,
    SchemaField,
    Section,
    build_prompt,
    call_keys,
    extract_fields,
    load_config,
    pack,
    scripted_batch_answer,
    split_answer,
    token_limit,
    validate_section,
)
from parley_gateway.grammar import close_response, contract_elements, fields_grammar, response_grammar
from parley_gateway.protection import CircuitBreaker, RetryPolicy
from parley_gateway.provider import ProviderRateLimited, ProviderRequest, ProviderUnavailable, Segment
from parley_gateway.remote import anthropic_blocks
from parley_gateway.scripted import HASH_DIMENSION, hash_vector
from parley_platform.errors import InvalidArgument, ParleyError

INTEGER_KEYS = [
    "BATCH_SIZE",
    "MAX_DRAIN_INTERVAL_MS",
    "MAX_SECTIONS_PER_CALL",
    "MAX_TOKENS_PER_CALL",
    "MAX_PARALLEL_CALLS",
]
FRACTION_KEYS = ["PACKING_DENSITY", "MODEL_SEPARATION"]
# The spec's list of invalid values, and more of the same kinds.
INVALID_ANYWHERE = [
    "abc",
    "12px",
    "1,000",
    "NaN",
    "nan",
    "inf",
    "0x10",
    "1e400",
    "1e3",
    "-4",
    "+5",
    "1 2",
    "٣",
]
INVALID_INTEGERS = [*INVALID_ANYWHERE, "2.5", "0", "00", "1.0", "2147483648"]
INVALID_FRACTIONS = [*INVALID_ANYWHERE, "1.01", "2", "-0", "0.5.5", "."]


def test_defaults_without_any_knob() -> None:
    assert load_config({}) == BatcherConfig(8, 30_000, 8, 0.85, 24_000, 2, 1.0)


@pytest.mark.parametrize("key", INTEGER_KEYS + FRACTION_KEYS)
@pytest.mark.parametrize("blank", ["", "   ", "\t"])
def test_blank_means_the_default(key: str, blank: str) -> None:
    assert load_config({f"PROMPT_BATCHER_{key}": blank}) == BatcherConfig()


@pytest.mark.parametrize(
    ("key", "raw", "attr", "value"),
    [
        ("BATCH_SIZE", "1", "batch_size", 1),
        ("BATCH_SIZE", "16", "batch_size", 16),
        ("BATCH_SIZE", " 12 ", "batch_size", 12),
        ("BATCH_SIZE", "007", "batch_size", 7),
        ("MAX_DRAIN_INTERVAL_MS", "250", "max_drain_interval_ms", 250),
        ("MAX_SECTIONS_PER_CALL", "3", "max_sections_per_call", 3),
        ("MAX_TOKENS_PER_CALL", "2147483647", "max_tokens_per_call", 2147483647),
        ("MAX_PARALLEL_CALLS", "4", "max_parallel_calls", 4),
        ("PACKING_DENSITY", "0", "packing_density", 0.0),
        ("PACKING_DENSITY", "1", "packing_density", 1.0),
        ("PACKING_DENSITY", "0.5", "packing_density", 0.5),
        ("PACKING_DENSITY", ".25", "packing_density", 0.25),
        ("PACKING_DENSITY", "1.0", "packing_density", 1.0),
        ("MODEL_SEPARATION", "0", "model_separation", 0.0),
        ("MODEL_SEPARATION", "0.3", "model_separation", 0.3),
    ],
)
def test_accepted_values(key: str, raw: str, attr: str, value: float) -> None:
    assert getattr(load_config({f"PROMPT_BATCHER_{key}": raw}), attr) == value


@pytest.mark.parametrize(
    ("key", "raw"),
    [(k, v) for k in INTEGER_KEYS for v in INVALID_INTEGERS]
    + [(k, v) for k in FRACTION_KEYS for v in INVALID_FRACTIONS],
)
def test_rejected_values_name_the_key_and_not_the_value(key: str, raw: str) -> None:
    with pytest.raises(InvalidArgument) as caught:
        load_config({f"PROMPT_BATCHER_{key}": raw, "PROMPT_BATCHER_UNRELATED": "x"})
    assert caught.value.code == "PROMPT_BATCHER_CONFIG_INVALID"
    assert f"PROMPT_BATCHER_{key}" in caught.value.message
    if raw.strip() not in ("0", "1", "2", "-4", "."):
        assert raw.strip() not in caught.value.message


@pytest.mark.parametrize(
    ("density", "priority", "expected"),
    [
        (0.85, "immediate", math.floor(24_000 * (0.35 + 0.65 * 0.85) * 0.65)),
        (0.85, "normal", math.floor(24_000 * (0.35 + 0.65 * 0.85) * 0.85)),
        (0.85, "background", math.floor(24_000 * (0.35 + 0.65 * 0.85))),
        (0.0, "immediate", math.floor(24_000 * 0.35 * 0.65)),
        (1.0, "background", 24_000),
    ],
)
def test_token_limit_formula(density: float, priority: str, expected: int) -> None:
    assert token_limit(BatcherConfig(packing_density=density), priority) == expected


def test_token_limit_never_below_512() -> None:
    assert token_limit(BatcherConfig(max_tokens_per_call=100, packing_density=0.0), "immediate") == 512


def make(id: str, tokens: int = 40, fields: int = 1, **extra: object) -> Section:
    # About four characters per token.
    return Section(
        id=id,
        agent_id=str(extra.pop("agent", "a1")),
        affinity="default",
        prompt="x" * (tokens * 4),
        fields=tuple(SchemaField(f"f{i}") for i in range(fields)),
        **extra,  # type: ignore[arg-type]
    )


def test_isolated_sections_get_their_own_call() -> None:
    calls = pack([make("a"), make("b", isolated=True), make("c")], BatcherConfig())
    assert sorted([s.id for s in c.sections] for c in calls) == [["a", "c"], ["b"]]


def test_packing_is_greedy_by_estimated_tokens_under_the_limit() -> None:
    config = BatcherConfig(max_tokens_per_call=1000, packing_density=1.0)  # normal: 850 tokens per call
    sections = [make("s300", 300), make("s500", 500), make("s200", 200), make("s100", 100)]
    calls = pack(sections, config)
    assert [[s.id for s in c.sections] for c in calls] == [["s500", "s300"], ["s200", "s100"]]
    assert all(c.tokens <= c.limit == 850 for c in calls)


def test_at_most_max_sections_per_call_fields_in_one_call() -> None:
    calls = pack([make(f"s{i}", 10, fields=3) for i in range(5)], BatcherConfig(max_sections_per_call=7))
    assert [c.field_count for c in calls] == [6, 6, 3]


def test_priorities_and_agents_never_share_a_call_and_immediate_goes_first() -> None:
    sections = [
        make("late", priority="background"),
        make("now", priority="immediate"),
        make("mine"),
        make("theirs", agent="a2"),
    ]
    calls = pack(sections, BatcherConfig())
    assert [(c.priority, c.agent_id, [s.id for s in c.sections]) for c in calls] == [
        ("immediate", "a1", ["now"]),
        ("normal", "a1", ["mine"]),
        ("normal", "a2", ["theirs"]),
        ("background", "a1", ["late"]),
    ]


def test_model_separation() -> None:
    small, large = make("small", 100), make("large", 100, tier="TEXT_LARGE")
    separated = pack([small, large], BatcherConfig(model_separation=1.0))
    assert sorted((c.tier, [s.id for s in c.sections]) for c in separated) == [
        ("TEXT_LARGE", ["large"]),
        ("TEXT_SMALL", ["small"]),
    ]
    merged = pack([small, large], BatcherConfig(model_separation=0.0))
    assert [(c.tier, sorted(s.id for s in c.sections)) for c in merged] == [
        ("TEXT_LARGE", ["large", "small"])
    ]
    # 0.999: only a small call filled at most 0.1 % of the limit (18 tokens) may ride along.
    assert len(pack([small, large], BatcherConfig(model_separation=0.999))) == 2
    assert len(pack([small, large], BatcherConfig(model_separation=0.99))) == 1


def test_prompt_namespaces_fields_and_the_answer_splits_back() -> None:
    first = Section("mood", "a1", "default", "How is the user?", (SchemaField("feeling", "one word"),))
    second = Section(
        "facts", "a1", "default", "Any facts?", (SchemaField("fact"), SchemaField("source", optional=True))
    )
    [call] = pack([first, second], BatcherConfig())
    system, prompt = build_prompt(call)
    assert system == ""
    assert "- mood__feeling: one word" in prompt
    assert "- facts__source: source (optional)" in prompt
    assert sorted(call_keys(call)) == ["facts__fact", "facts__source", "mood__feeling"]
    answer = (
        "noise <response><mood__feeling> happy </mood__feeling>"
        "<facts__fact>x &amp; y</facts__fact></response>"
    )
    found = extract_fields(answer, call_keys(call))
    assert split_answer(first, found).fields == {"feeling": "happy"}
    assert split_answer(second, found).fields == {"fact": "x & y"}  # the optional field may be absent
    assert split_answer(second, {}).error == "missing field facts__fact"


def test_scripted_answers_every_field_of_a_packed_prompt() -> None:
    section = Section("q", "a1", "default", "?", (SchemaField("a"), SchemaField("b")))
    [call] = pack([section], BatcherConfig())
    _, prompt = build_prompt(call)
    answer = scripted_batch_answer(prompt)
    assert answer == "<response><q__a>scripted</q__a><q__b>scripted</q__b></response>"
    assert scripted_batch_answer("# Current message\nbob: hi") is None


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"id": "bad id"}, "section.id"),
        ({"id": "a__b"}, "section.id"),
        ({"agent_id": ""}, "section.agent_id"),
        ({"affinity": "elsewhere"}, "section.affinity"),
        ({"prompt": "  "}, "section.prompt"),
        ({"fields": ()}, "section.fields"),
        ({"fields": (SchemaField("ok"), SchemaField("ok"))}, "section.fields[1].name"),
        ({"fields": (SchemaField("1x"),)}, "section.fields[0].name"),
        ({"fields": (SchemaField("x", pattern="("),)}, "section.fields[0].pattern"),
        ({"fallback": {"nope": "x"}}, "section.fallback"),
        ({"frequency": "recurring"}, "section.min_cycle_ms"),
        ({"min_cycle_ms": 5}, "section.min_cycle_ms"),
        ({"max_retries": 3}, "section.max_retries"),
    ],
)
def test_invalid_sections_name_the_field(change: dict[str, object], named: str) -> None:
    base = {
        "id": "ok",
        "agent_id": "a1",
        "affinity": "room:r-1",
        "prompt": "?",
        "fields": (SchemaField("x"),),
    }
    with pytest.raises(InvalidArgument) as caught:
        validate_section(Section(**{**base, **change}))  # type: ignore[arg-type]
    assert caught.value.code == "INVALID_SECTION"
    assert caught.value.message.startswith(named)


def test_response_grammar_is_bounded_by_the_token_budget() -> None:
    grammar = response_grammar(200)
    assert grammar.startswith('root ::= "<response>" e0 e1 e2 "</response>"')
    assert 'e0 ::= "<thought>" t0 "</thought>"' in grammar
    assert 'e1 ::= "<actions>" names1 "</actions>"' in grammar
    assert "t0 ::= [^<>&]{0,52}" in grammar  # (200 - 3 × 12 - 8) // 3 shares
    assert "t2 ::= [^<>&]{0,104}" in grammar  # text gets two shares
    # With a large budget the private thought stays short; the text takes the room.
    roomy = response_grammar(512)
    assert "t0 ::= [^<>&]{0,96}" in roomy
    assert "t2 ::= [^<>&]{0,312}" in roomy
    keys = fields_grammar(["a__x", "b__y"], 200)
    assert 'f0 ::= "<a__x>" value "</a__x>"' in keys
    assert keys.startswith('root ::= "<response>" f0 f1 "</response>"')


FORMAT = """# Output format
<response>
  <thought>a short private thought</thought>
  <actions>REPLY</actions>
  <providers></providers>
  <text>what you say</text>
</response>
<actions> lists the actions; give params as <params><ACTION><p>v</p></ACTION></params>.
"""
SHOULD_RESPOND = """# Should Eliza respond?
bob: <response><text>pick me</text></response>
Answer with exactly:
<response><name>Eliza</name><reasoning>one sentence</reasoning>
<action>RESPOND|IGNORE|STOP</action></response>
"""


@pytest.mark.parametrize(
    ("stable", "prompt", "elements"),
    [
        (FORMAT, FORMAT + "\n# Current message\nbob: <response><text>x</text></response>", None),
        ("", SHOULD_RESPOND, ("name", "reasoning", "action")),
        ("", "just talk to me", ("thought", "actions", "text")),
        ("# Agent\nno format here", "plain", ("thought", "actions", "text")),
    ],
    ids=["turn-format-beats-the-user", "last-example-wins", "no-example", "stable-without-example"],
)
def test_the_contract_comes_from_the_prompts_own_format(
    stable: str, prompt: str, elements: tuple[str, ...] | None
) -> None:
    expected = elements or ("thought", "actions", "providers", "text")
    assert contract_elements(stable, prompt) == expected


def test_a_cut_answer_of_another_contract_is_closed_too() -> None:
    elements = ("name", "reasoning", "action")
    assert (
        close_response("<response><name>Eliza</name><reas", elements)
        == "<response><name>Eliza</name><reasoning></reasoning><action>NONE</action></response>"
    )


@pytest.mark.parametrize(
    ("cut", "expected"),
    [
        ("", "<response><thought></thought><actions>REPLY</actions><text></text></response>"),
        ("<response><thou", "<response><thought></thought><actions>REPLY</actions><text></text></response>"),
        (
            "<response><thought>hm",
            "<response><thought>hm</thought><actions>REPLY</actions><text></text></response>",
        ),
        (
            "<response><thought>a</thought><actions>REPLY,",
            "<response><thought>a</thought><actions>REPLY</actions><text></text></response>",
        ),
        (
            "<response><thought>a</thought><actions>",
            "<response><thought>a</thought><actions>REPLY</actions><text></text></response>",
        ),
        (
            "<response><thought>a</thought><actions>REPLY</actions><text>Hello wor",
            "<response><thought>a</thought><actions>REPLY</actions><text>Hello wor</text></response>",
        ),
        (
            "<response><thought>a</thought><actions>REPLY</actions><text>Hi</te",
            "<response><thought>a</thought><actions>REPLY</actions><text>Hi</text></response>",
        ),
        (
            "<response><thought>a</thought><actions>X</actions><text>Hi</text>",
            "<response><thought>a</thought><actions>X</actions><text>Hi</text></response>",
        ),
    ],
)
def test_a_cut_answer_is_closed_into_a_whole_block(cut: str, expected: str) -> None:
    closed = close_response(cut)
    assert closed == expected
    assert close_response(closed) == closed


def test_circuit_breaker_opens_half_opens_and_closes() -> None:
    now = [0.0]
    breaker = CircuitBreaker("p", threshold=2, reset_seconds=10, clock=lambda: now[0])
    breaker.failure()
    breaker.admit()
    breaker.failure()
    assert breaker.state == "open"
    with pytest.raises(ParleyError) as caught:
        breaker.admit()
    assert caught.value.code == "CIRCUIT_OPEN"
    now[0] = 10.0
    assert breaker.state == "half_open"
    breaker.admit()  # the one trial call
    with pytest.raises(ParleyError):
        breaker.admit()
    breaker.failure()  # the trial failed: open again
    assert breaker.state == "open"
    now[0] = 20.0
    breaker.admit()
    breaker.success()
    assert breaker.state == "closed"
    breaker.admit()


def test_backoff_is_jittered_exponential_with_retry_after_as_a_floor() -> None:
    policy = RetryPolicy(attempts=5, base_delay=0.1, max_delay=0.5)
    rng = random.Random(7)
    error = ProviderUnavailable("down")
    delays = [[policy.delay(attempt, error, rng) for _ in range(200)] for attempt in (1, 2, 3, 4)]
    assert [max(d) <= cap for d, cap in zip(delays, (0.1, 0.2, 0.4, 0.5), strict=True)] == [True] * 4
    assert len({round(d, 6) for d in delays[0]}) > 100  # jittered, not a fixed step
    assert policy.delay(1, ProviderRateLimited("slow down", retry_after=2.0), rng) >= 2.0


def test_stable_segments_go_first_without_touching_the_request() -> None:
    segments = (
        Segment("now ", False),
        Segment("rules ", True),
        Segment("history ", False),
        Segment("me", True),
    )
    request = ProviderRequest("TEXT_SMALL", "now rules history me", segments=segments)
    assert request.ordered_prompt() == "rules menow history "
    assert request.segments == segments


def test_anthropic_marks_the_end_of_each_stable_run_at_most_three_times() -> None:
    segments = [Segment(f"s{i}", i % 2 == 0) for i in range(10)]
    blocks = anthropic_blocks(segments)
    marked = [b["text"] for b in blocks if "cache_control" in b]
    assert marked == ["s0", "s2", "s4"]


def _dense_hash_vector(text: str, dimension: int) -> list[float]:
    """hash_vector as first written: every place summed and scaled."""
    vector = [0.0] * dimension
    for word in re.findall(r"\w+", text.lower()) or [text]:
        digest = hashlib.blake2b(word.encode(), digest_size=8).digest()
        vector[int.from_bytes(digest[:4], "little") % dimension] += 1.0 if digest[4] & 1 else -1.0
    norm = math.sqrt(sum(v * v for v in vector)) or 1.0
    return [v / norm for v in vector]


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=400), st.sampled_from([HASH_DIMENSION, 8, 1]))
def test_hash_vectors_are_the_same_as_when_every_place_was_scaled(text: str, dimension: int) -> None:
    assert hash_vector(text, dimension) == _dense_hash_vector(text, dimension)


@pytest.mark.parametrize("text", ["", "   ", "a a a", "x " * 500, "héllo wörld 42", "cat CAT cat dog"])
def test_hash_vectors_of_chosen_texts_are_the_same_as_when_every_place_was_scaled(text: str) -> None:
    assert hash_vector(text, HASH_DIMENSION) == _dense_hash_vector(text, HASH_DIMENSION)


def test_hash_vectors_are_deterministic_unit_vectors() -> None:
    one = hash_vector("The cat sat", HASH_DIMENSION)
    assert one == hash_vector("the CAT sat", HASH_DIMENSION)
    assert len(one) == HASH_DIMENSION
    assert math.isclose(sum(v * v for v in one), 1.0)
    assert re.fullmatch(r"\d+", str(len(hash_vector("", HASH_DIMENSION))))
