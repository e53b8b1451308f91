"""Plugins' declared settings, dependencies and load order, and the autonomy policy's settings
(pure: no infrastructure)."""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping

import pytest

from parley.v1 import model_pb2
from parley_platform.errors import ParleyError
from parley_runtime.autonomy import policy
from parley_runtime.plugins.loading import resolve_plugins, validate_plugin
from parley_runtime.plugins.settings import plugin_settings
from parley_runtime.sdk import Plugin, Setting
from parley_runtime.turn.stages.think import PLAN_METADATA, response_of


def lookup(values: Mapping[str, object]):  # type: ignore[no-untyped-def]
    return lambda key: values.get(key)


CONFIGURED = Plugin(
    name="configured",
    config=(
        Setting("API_URL", "where to call", required=True),
        Setting("RETRIES", schema={"type": "integer", "minimum": 0, "maximum": 5}, default=2),
        Setting("VERBOSE", schema={"type": "boolean"}),
    ),
)


def test_settings_are_read_converted_and_checked() -> None:
    assert plugin_settings(
        CONFIGURED, lookup({"API_URL": "https://x", "RETRIES": "3", "VERBOSE": "yes"})
    ) == {
        "API_URL": "https://x",
        "RETRIES": 3,
        "VERBOSE": True,
    }
    assert plugin_settings(CONFIGURED, lookup({"API_URL": "https://x"})) == {
        "API_URL": "https://x",
        "RETRIES": 2,
    }


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({}, "setting API_URL is required"),
        ({"API_URL": "u", "RETRIES": "lots"}, "setting RETRIES does not match its schema (type: integer)"),
        ({"API_URL": "u", "RETRIES": 9}, "setting RETRIES does not match its schema (maximum: 5)"),
        ({"API_URL": "u", "VERBOSE": "maybe"}, "setting VERBOSE does not match its schema (type: boolean)"),
    ],
)
def test_a_missing_or_invalid_setting_is_refused_naming_it_not_its_value(
    values: dict[str, object], message: str
) -> None:
    with pytest.raises(ParleyError) as caught:
        plugin_settings(CONFIGURED, lookup(values))
    assert caught.value.code == "PLUGIN_CONFIG_INVALID"
    assert message in str(caught.value)
    assert "lots" not in str(caught.value)
    assert "maybe" not in str(caught.value)


def test_plugins_load_after_their_dependencies() -> None:
    base = Plugin(name="base")
    middle = Plugin(name="middle", dependencies=("base",))
    top = Plugin(name="top", dependencies=("middle", "base"))
    builtins = {"base": base, "middle": middle, "top": top}
    assert [p.name for p in resolve_plugins(["top"], builtins=builtins)] == ["base", "middle", "top"]
    assert [p.name for p in resolve_plugins(["base", "top", "middle"], builtins=builtins)] == [
        "base",
        "middle",
        "top",
    ]


def test_a_dependency_cycle_or_a_missing_dependency_is_refused() -> None:
    a = Plugin(name="a", dependencies=("b",))
    b = Plugin(name="b", dependencies=("a",))
    with pytest.raises(ParleyError, match="cycle: a -> b -> a"):
        resolve_plugins(["a"], builtins={"a": a, "b": b})
    lonely = Plugin(name="lonely", dependencies=("nowhere",))
    with pytest.raises(ParleyError, match="plugin 'lonely' depends on 'nowhere'") as caught:
        resolve_plugins(["lonely"], builtins={"lonely": lonely})
    assert caught.value.code == "PLUGIN_NOT_FOUND"


def test_malformed_services_events_and_settings_are_refused() -> None:
    class Nameless:
        name = "has space"

        async def start(self, run: object) -> None: ...
        async def stop(self) -> None: ...

    async def handler(event: object) -> None: ...

    cases = [
        (Plugin(name="p", services=(Nameless(),)), "a service name"),  # type: ignore[arg-type]
        (Plugin(name="p", events={"run ended": (handler,)}), "is not SCREAMING_SNAKE_CASE"),
        (Plugin(name="p", config=(Setting("X"), Setting("X"))), "declared twice"),
        (Plugin(name="p", config=(Setting("X", schema={"type": "nonsense"}),)), "invalid JSON schema"),
    ]
    for plugin, message in cases:
        with pytest.raises(ParleyError, match=message):
            validate_plugin(plugin, "test")


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (None, 30_000),
        ("", 30_000),
        ("15000", 15_000),
        (15000, 15_000),
        ("1000", 5_000),
        ("9999999", 600_000),
        ("015000", 30_000),  # not canonical
        ("15000.0", 30_000),
        ("-5000", 30_000),
        (" 15000", 30_000),
        (True, 30_000),
    ],
)
def test_autonomy_interval_is_canonical_and_clamped(value: object, expected: int) -> None:
    assert policy.interval_ms(value) == expected


@pytest.mark.parametrize(
    ("value", "expected"), [("small", "small"), ("large", "large"), ("Small", "large"), (None, "large")]
)
def test_autonomy_model_size_is_exactly_small_or_large(value: object, expected: str) -> None:
    assert policy.model_size(value) == expected


def test_a_think_result_becomes_one_autonomous_message_and_its_plan() -> None:
    result = model_pb2.SectionResult(
        section_id="autonomy-1-abc",
        agent_id="a",
        drain_seq=7,
        fields={
            "thought": "x" * 5000,
            "actions": "NOTE, none",
            "text": "",
            "params": "<NOTE><a>1</a></NOTE>",
        },
    )
    agent = uuid.uuid4()
    message = policy.message_of(agent, "thinker", result)
    assert message.message_id == "autonomy-1-abc-7"
    assert message.source == "autonomy"
    assert message.sender_id == str(agent)
    assert len(message.metadata[PLAN_METADATA]) <= policy.MAX_METADATA
    assert json.loads(message.metadata[PLAN_METADATA])["actions"] == "NOTE, none"
    response = response_of(message.metadata)
    assert "<actions>NOTE</actions>" in response
    assert "<params><NOTE><a>1</a></NOTE></params>" in response
    assert "<actions>IGNORE</actions>" in response_of({PLAN_METADATA: json.dumps({"actions": "NONE"})})
    assert "<actions>REPLY</actions>" in response_of({PLAN_METADATA: json.dumps({"text": "a note"})})
    assert "<actions>IGNORE</actions>" in response_of({PLAN_METADATA: "not json"})
