"""Pure parts of the runtime and gateway: characters, ids, prompts, the scripted model, validation."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from parley.v1 import model_pb2, runtime_pb2
from parley_gateway.api import MAX_PROMPT_CHARS, to_call
from parley_gateway.provider import ProviderRequest, Segment
from parley_gateway.scripted import Rule, ScriptedProvider, load_rules
from parley_platform.consumer import Poison
from parley_platform.errors import InvalidArgument
from parley_runtime import ids
from parley_runtime.agents.directory import AgentInfo
from parley_runtime.character import Character, load_characters, parse_character
from parley_runtime.parser import normalize_actions, parse_response
from parley_runtime.sdk import State
from parley_runtime.turn.inbound import decode_inbound
from parley_runtime.turn.prompt import build_turn_prompt, join_segments
from support import ROOT


def test_default_character_loads() -> None:
    [character] = load_characters(ROOT / "characters")
    assert character.name == "default"
    assert character.agent_id == ids.agent_id("default")
    assert "secrets" not in character.document()


@pytest.mark.parametrize(
    ("document", "mentions"),
    [
        ({"bio": ["no name"]}, "name: Field required"),
        ({"name": ""}, "name:"),
        ({"name": "ok", "knowledge": [{"text": ""}]}, "knowledge.0.text"),
        (
            {"name": "ok", "messageExamples": [{"examples": [{"user": 5, "content": {"text": "x"}}]}]},
            "0.0.name",
        ),
        ({"name": "ok", "messageExamples": [[{"name": "u"}]]}, "messageExamples.0.0.text"),
        ({"name": "bad/name"}, "name:"),
    ],
)
def test_invalid_characters_name_the_field(document: dict[str, object], mentions: str) -> None:
    with pytest.raises(InvalidArgument) as failure:
        parse_character(document, "test.yaml")
    assert failure.value.code == "CHARACTER_INVALID"
    assert mentions in failure.value.message


def test_duplicate_character_names_are_refused(tmp_path: Path) -> None:
    (tmp_path / "a.yaml").write_text("name: twin\n")
    (tmp_path / "b.json").write_text('{"name": "twin"}')
    with pytest.raises(InvalidArgument, match="share names: twin"):
        load_characters(tmp_path)


def test_ids_are_deterministic_and_scoped_by_agent() -> None:
    a, b = ids.agent_id("a"), ids.agent_id("b")
    assert ids.room_id(a, "discord", "42") == ids.room_id(a, "discord", "42")
    assert ids.room_id(a, "discord", "42") != ids.room_id(b, "discord", "42")
    assert ids.room_id(a, "discord", "42") != ids.room_id(a, "telegram", "42")
    assert ids.entity_id(a, "discord", "42") != ids.room_id(a, "discord", "42")
    inbound = ids.message_id(a, "discord", "m1")
    assert ids.response_id(inbound) == ids.response_id(inbound) != ids.response_id(inbound, 1)


def test_prompt_segments_join_to_the_prompt_and_stable_comes_first() -> None:
    character = Character(name="Ada", system="Be brief.", bio=["Engineer."])
    state = State(
        texts={"CHARACTER": "# About Ada", "RECENT_MESSAGES": "bob: earlier line", "ACTIONS": "- REPLY"}
    )
    segments = build_turn_prompt(character, state, "bob", "now?")
    assert [s.stable for s in segments] == [True, False, False]
    prompt = join_segments(segments)
    assert prompt == "".join(s.content for s in segments)
    assert "You are Ada." in segments[0].content
    assert "# About Ada" in segments[0].content
    assert "- REPLY" in segments[0].content
    assert "bob: earlier line" in segments[1].content
    assert prompt.endswith("# Current message\nbob: now?\n")


async def test_scripted_echo_answers_in_the_response_contract() -> None:
    provider = ScriptedProvider()
    character = Character(name="Ada")
    prompt = join_segments(build_turn_prompt(character, State(), "bob", 'a <tag> & "quotes"'))
    completion = await provider.generate(ProviderRequest(model_type="TEXT_LARGE", prompt=prompt))
    parsed = parse_response(completion.text)
    assert parsed is not None
    assert parsed.text == 'You said: a <tag> & "quotes"'
    assert normalize_actions(parsed) == ["REPLY"]
    assert completion.input_tokens > 0


async def test_scripted_rules_match_in_order_with_named_groups() -> None:
    provider = ScriptedProvider(
        rules=[
            Rule(match=r"weather in (?P<city>\w+)", text="Sunny in {city}.", actions=["REPLY"]),
            Rule(match=r"raw please", raw="plain words"),
        ]
    )
    said = await provider.generate(
        ProviderRequest(model_type="TEXT_SMALL", prompt="what is the weather in Oslo")
    )
    assert "Sunny in Oslo." in said.text
    raw = await provider.generate(ProviderRequest(model_type="TEXT_SMALL", prompt="raw please"))
    assert raw.text == "plain words"


@pytest.mark.parametrize(
    ("rule", "prompt", "answer"),
    [
        # A place for each named group, as often as the template names it.
        (
            Rule(match=r"(?P<a>\w+) and (?P<b>\w+)", raw="{b}, {a}, {b}"),
            "salt and pepper",
            "pepper, salt, pepper",
        ),
        # A group that matched nothing fills its place with nothing.
        (Rule(match=r"hi(?P<name> \w+)?", raw="[{name}]"), "hi", "[]"),
        # Braces that name no group are the answer's own text: JSON, format-like words.
        (
            Rule(match=r"json (?P<v>\d+)", raw='{"v": {v}, "other": "{other}", "empty": {}}'),
            "json 42",
            '{"v": 42, "other": "{other}", "empty": {}}',
        ),
        (Rule(match=r"x", raw="{{x}} {0} }{"), "x", "{{x}} {0} }{"),
        # A reply text is escaped for the <response> contract after its places are filled.
        (Rule(match=r"say (?P<what>.+)", text="{what} & more"), "say <b>", "&lt;b&gt; &amp; more"),
    ],
)
async def test_scripted_rules_fill_their_groups_and_keep_other_braces(
    rule: Rule, prompt: str, answer: str
) -> None:
    provider = ScriptedProvider(rules=[rule])
    said = await provider.generate(ProviderRequest(model_type="TEXT_SMALL", prompt=prompt))
    if rule.raw is not None:
        assert said.text == answer
    else:
        assert f"<text>{answer}</text>" in said.text
        parsed = parse_response(said.text)
        assert parsed is not None
        assert parsed.text == "<b> & more"


def test_scripted_rule_files_are_validated(tmp_path: Path) -> None:
    good = tmp_path / "good.yaml"
    good.write_text("rules:\n  - match: hi\n    text: hello\n")
    assert load_rules(good)[0].text == "hello"
    bad = tmp_path / "bad.yaml"
    bad.write_text("rules:\n  - match: '('\n")
    with pytest.raises(InvalidArgument, match=r"rule 0 field match"):
        load_rules(bad)
    assert load_rules(ROOT / "tests" / "e2e" / "rules.yaml")


@pytest.mark.parametrize(
    ("request_", "code"),
    [
        (model_pb2.GenerateRequest(prompt="x"), "UNKNOWN_MODEL_TYPE"),
        (model_pb2.GenerateRequest(model_type=model_pb2.MODEL_TYPE_TEXT_SMALL), "PROMPT_REQUIRED"),
        (
            model_pb2.GenerateRequest(
                model_type=model_pb2.MODEL_TYPE_TEXT_SMALL,
                prompt="ab",
                segments=[model_pb2.PromptSegment(content="a"), model_pb2.PromptSegment(content="c")],
            ),
            "PROMPT_SEGMENTS_MISMATCH",
        ),
        (
            model_pb2.GenerateRequest(
                model_type=model_pb2.MODEL_TYPE_TEXT_SMALL, segments=[model_pb2.PromptSegment(content="")]
            ),
            "PROMPT_REQUIRED",
        ),
        (
            model_pb2.GenerateRequest(
                model_type=model_pb2.MODEL_TYPE_TEXT_SMALL, prompt="x", stop_sequences=[""]
            ),
            "INVALID_STOP",
        ),
        (
            model_pb2.GenerateRequest(model_type=model_pb2.MODEL_TYPE_TEXT_SMALL, prompt="x", max_tokens=-1),
            "INVALID_MAX_TOKENS",
        ),
        (
            model_pb2.GenerateRequest(model_type=model_pb2.MODEL_TYPE_TEXT_SMALL, prompt="x", temperature=3),
            "INVALID_TEMPERATURE",
        ),
    ],
)
def test_generate_requests_are_validated(request_: model_pb2.GenerateRequest, code: str) -> None:
    with pytest.raises(InvalidArgument) as failure:
        to_call(request_, "generate")
    assert failure.value.code == code


def test_a_valid_request_becomes_the_engines_call() -> None:
    call = to_call(
        model_pb2.GenerateRequest(
            agent_id="a-1",
            model_type=model_pb2.MODEL_TYPE_TEXT_LARGE,
            prompt="ab",
            segments=[
                model_pb2.PromptSegment(content="a", stable=True),
                model_pb2.PromptSegment(content="b"),
            ],
            system="be brief",
            max_tokens=7,
            stop_sequences=["\n\n"],
            response_grammar="root ::= x",
        ),
        "stream",
    )
    assert (call.agent_id, call.kind) == ("a-1", "stream")
    assert call.request == ProviderRequest(
        model_type="TEXT_LARGE",
        prompt="ab",
        system="be brief",
        segments=(Segment("a", True), Segment("b", False)),
        temperature=None,
        max_tokens=7,
        stop=("\n\n",),
        grammar="root ::= x",
    )
    zero = to_call(
        model_pb2.GenerateRequest(model_type=model_pb2.MODEL_TYPE_TEXT_SMALL, prompt="x", temperature=0),
        "generate",
    )
    assert zero.request.temperature == 0.0


def test_segments_without_a_prompt_are_the_prompt() -> None:
    # The runtime sends the segments alone: the prompt is their concatenation, sent once.
    call = to_call(
        model_pb2.GenerateRequest(
            model_type=model_pb2.MODEL_TYPE_TEXT_LARGE,
            segments=[
                model_pb2.PromptSegment(content="a", stable=True),
                model_pb2.PromptSegment(content="b"),
            ],
        ),
        "generate",
    )
    assert call.request.prompt == "ab"
    assert call.request.segments == (Segment("a", True), Segment("b", False))
    with pytest.raises(InvalidArgument) as failure:
        to_call(
            model_pb2.GenerateRequest(
                model_type=model_pb2.MODEL_TYPE_TEXT_LARGE,
                segments=[model_pb2.PromptSegment(content="x" * (MAX_PROMPT_CHARS + 1))],
            ),
            "generate",
        )
    assert failure.value.code == "PROMPT_TOO_LARGE"


AGENT = AgentInfo(ids.agent_id("default"), Character(name="default"))
AGENTS = {str(AGENT.id): AGENT}


def _inbound(**fields: object) -> bytes:
    base: dict[str, object] = {
        "agent_id": str(AGENT.id),
        "source": "discord",
        "message_id": "m1",
        "sender_id": "u1",
        "channel_id": "c1",
        "text": "hi",
    }
    base.update(fields)
    return runtime_pb2.InboundMessage(**base).SerializeToString()  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("payload", "label"),
    [
        (b"\xff\xff\xff", "undecodable"),
        (_inbound(agent_id=str(uuid.uuid4())), "agent"),
        (_inbound(source=""), "no_source"),
        (_inbound(source="a b"), "bad_source"),
        (_inbound(message_id=""), "no_message_id"),
        (_inbound(channel_id=""), "no_channel"),
        (_inbound(sender_id=""), "no_sender"),
        (_inbound(text="é" * 6), "too_large"),
    ],
)
def test_bad_inbound_payloads_are_poison(payload: bytes, label: str) -> None:
    with pytest.raises(Poison) as failure:
        decode_inbound(payload, str(AGENT.id), AGENTS, max_text_bytes=10)
    assert failure.value.label == label


def test_agent_id_may_come_from_the_subject() -> None:
    message, agent = decode_inbound(_inbound(agent_id=""), str(AGENT.id), AGENTS, max_text_bytes=100)
    assert agent is AGENT
    assert message.agent_id == str(AGENT.id)


def test_unknown_agent_on_its_own_subject_is_poison() -> None:
    other = str(uuid.uuid4())
    with pytest.raises(Poison, match="unknown agent"):
        decode_inbound(_inbound(agent_id=other), other, AGENTS, max_text_bytes=100)
