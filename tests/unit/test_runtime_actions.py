"""Actions: catalog lookup, permissions, parameters, resolve_action_args, sub-actions, plugins."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest

from parley_platform.errors import InvalidArgument
from parley_runtime.character import Character
from parley_runtime.plugins.arguments import (
    coerce_params,
    missing_required,
    parse_confidence,
    resolve_action_args,
    schema_errors,
)
from parley_runtime.plugins.basic import basic_capabilities
from parley_runtime.plugins.catalog import Catalog, permission_error
from parley_runtime.plugins.loading import discover_plugins, load_plugin, resolve_plugins, validate_plugin
from parley_runtime.sdk import (
    Action,
    ActionResult,
    MessageView,
    Parameter,
    Plugin,
    TurnContext,
    UnknownSubaction,
    dispatch_subaction,
    normalise_subaction,
)
from support import ROOT


async def _ok(ctx: Any, params: dict[str, Any], callback: Any) -> ActionResult:
    return ActionResult(True)


TRANSFER = Action(
    "TRANSFER_FUNDS",
    "move money",
    _ok,
    similes=("SEND_MONEY",),
    parameters=(
        Parameter(
            "amount", required=True, schema={"type": "number", "exclusiveMinimum": 0}, aliases=("sum",)
        ),
        Parameter("to", required=True),
        Parameter("tags", schema={"type": "array", "items": {"type": "string"}}),
    ),
)
LISTED = Action(
    "TAG_ITEMS",
    "tag items",
    _ok,
    parameters=(Parameter("tags", required=True, schema={"type": "array"}),),
    allow_empty_arrays=frozenset({"tags"}),
)


class _Services:
    async def set_room_state(self, *a: Any, **k: Any) -> None: ...


def ctx(*, autonomous: bool = False, role: str = "MEMBER") -> TurnContext:
    message = MessageView(
        id=uuid.uuid4(),
        text="hi",
        source="t",
        channel_id="c",
        room_id=uuid.uuid4(),
        room_type="GROUP",
        sender_id=uuid.uuid4(),
        sender_name="Bo",
        autonomous=autonomous,
    )
    return TurnContext(
        agent_id=uuid.uuid4(),
        character=Character(name="A"),
        message=message,
        role=role,
        history=[],
        participants=[],
        services=_Services(),
    )  # type: ignore[arg-type]


def test_catalog_finds_actions_by_name_or_simile_case_insensitively() -> None:
    catalog = Catalog([basic_capabilities, Plugin("money", actions=(TRANSFER,))])
    assert catalog.find("reply") is catalog.find("REPLY") is catalog.find(" Respond ")
    assert catalog.find("send_money") is TRANSFER
    assert catalog.find("nope") is None
    assert catalog.providers[0].name == "CHARACTER"  # ordered by position


def test_two_plugins_defining_one_action_is_an_error() -> None:
    with pytest.raises(InvalidArgument, match="defined by two plugins"):
        Catalog([Plugin("a", actions=(TRANSFER,)), Plugin("b", actions=(TRANSFER,))])


def test_private_actions_only_on_autonomous_turns_and_role_gates() -> None:
    private = Action("SECRET_OP", "x", _ok, private=True)
    admin = Action("ADMIN_OP", "x", _ok, roles=frozenset({"OWNER", "ADMIN"}))
    assert permission_error(private, ctx()) is not None
    assert permission_error(private, ctx(autonomous=True)) is None
    assert "needs the role" in (permission_error(admin, ctx(role="MEMBER")) or "")
    assert permission_error(admin, ctx(role="ADMIN")) is None


def test_params_map_aliases_and_decode_json_for_non_string_schemas() -> None:
    params = coerce_params(TRANSFER, {"SUM": "12.5", "to": "bob", "tags": '["a", "b"]'})
    assert params == {"amount": 12.5, "to": "bob", "tags": ["a", "b"]}
    assert schema_errors(TRANSFER, params) == []
    assert schema_errors(TRANSFER, coerce_params(TRANSFER, {"amount": "-3", "to": "x"})) == [
        "amount: -3 is less than or equal to the minimum of 0"
    ]
    assert schema_errors(TRANSFER, {"amount": "lots", "to": "x"}) == [
        "amount: 'lots' is not of type 'number'"
    ]


@pytest.mark.parametrize(
    ("params", "missing"),
    [
        ({"amount": 1, "to": "x"}, []),
        ({"amount": 1}, ["to"]),
        ({"amount": 1, "to": "   "}, ["to"]),
        ({"amount": None, "to": "x"}, ["amount"]),
    ],
)
def test_missing_required(params: dict[str, Any], missing: list[str]) -> None:
    assert missing_required(TRANSFER, params) == missing


def test_allow_empty_arrays_keeps_an_explicit_empty_list_but_never_invents_one() -> None:
    assert missing_required(LISTED, {"tags": []}) == []
    assert missing_required(LISTED, {}) == ["tags"]
    strict = Action(
        "STRICT", "x", _ok, parameters=(Parameter("tags", required=True, schema={"type": "array"}),)
    )
    assert missing_required(strict, {"tags": []}) == ["tags"]


class Model:
    """A scripted model for resolve_action_args: answers in order and records the prompts."""

    def __init__(self, *answers: str) -> None:
        self.answers = list(answers)
        self.prompts: list[str] = []

    async def __call__(self, prompt: str) -> str:
        self.prompts.append(prompt)
        return self.answers.pop(0)


async def test_complete_planner_params_are_trusted_without_a_model_call() -> None:
    model = Model()
    resolved = await resolve_action_args(
        TRANSFER, {"amount": "5", "to": "amy"}, extract=model, intent="pay amy", recent=[]
    )
    assert resolved.params == {"amount": 5, "to": "amy"}
    assert model.prompts == []
    assert resolved.extraction_calls == 0


async def test_missing_params_get_one_extraction_call_and_planner_values_win() -> None:
    model = Model('{"amount": 7, "to": "zed", "confidence": 0.9}')
    recent = [f"line {i}" for i in range(20)]
    resolved = await resolve_action_args(
        TRANSFER, {"to": "amy"}, extract=model, intent="pay amy", recent=recent
    )
    assert resolved.params == {"amount": 7, "to": "amy"}
    assert resolved.missing == []
    assert resolved.confidence == 0.9
    assert resolved.clarification is None
    assert len(model.prompts) == 1
    assert "line 19" in model.prompts[0]
    assert "line 11" not in model.prompts[0]  # only the last 8 lines


async def test_a_non_json_answer_gets_one_repair_retry_then_gives_up() -> None:
    model = Model("sure! amount is 3", "still not json")
    resolved = await resolve_action_args(TRANSFER, {}, extract=model, intent="pay", recent=[])
    assert len(model.prompts) == 2
    assert "not a JSON object" in model.prompts[1]
    assert resolved.missing == ["amount", "to"]

    model = Model("nope", '```json\n{"amount": 2, "to": "bo"}\n```')
    resolved = await resolve_action_args(TRANSFER, {}, extract=model, intent="pay", recent=[])
    assert resolved.params == {"amount": 2, "to": "bo"}
    assert resolved.extraction_calls == 2


async def test_low_confidence_asks_for_clarification() -> None:
    model = Model('{"amount": 2, "to": "bo", "confidence": 0.2}')
    resolved = await resolve_action_args(TRANSFER, {}, extract=model, intent="pay?", recent=[])
    assert resolved.clarification is not None
    assert "TRANSFER_FUNDS" in resolved.clarification


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (0.5, 0.5),
        (1, 1.0),
        (1.7, 1.0),
        (-2, 0.0),
        ("0.9", None),
        (True, None),
        (None, None),
        (float("nan"), None),
        (float("inf"), None),
    ],
)
def test_confidence_is_a_strict_json_number_clamped(value: object, expected: float | None) -> None:
    assert parse_confidence(value) == expected


@pytest.mark.parametrize(
    ("params", "chosen"),
    [
        ({"action": "Add Item"}, "add_item"),
        ({"subaction": "removeItem"}, "remove_item"),
        ({"op": "add-item"}, "add_item"),
        ({"operation": "LIST"}, "list"),
        ({"verb": "  list  "}, "list"),
        ({"op": "list", "action": "add item"}, "add_item"),  # action comes first
    ],
)
def test_sub_action_dispatch(params: dict[str, Any], chosen: str) -> None:
    handlers = {"add_item": 1, "remove_item": 2, "list": 3}
    assert dispatch_subaction(params, handlers)[0] == chosen


def test_unknown_or_missing_sub_action() -> None:
    with pytest.raises(UnknownSubaction) as failure:
        dispatch_subaction({"op": "explode"}, {"list": 1})
    assert failure.value.code == "UNKNOWN_SUBACTION"
    with pytest.raises(UnknownSubaction):
        dispatch_subaction({}, {"list": 1})
    assert normalise_subaction("HTTPRequest now") == "httprequest_now"


@pytest.mark.parametrize(
    ("plugin", "mentions"),
    [
        ("not a plugin", "expected a parley_runtime.sdk.Plugin"),
        (Plugin(""), "name must not be empty"),
        (Plugin("p", actions=(Action("lower", "x", _ok),)), "SCREAMING_SNAKE_CASE"),
        (Plugin("p", actions=(TRANSFER, TRANSFER)), "declared twice"),
        (Plugin("p", actions=(Action("A", "x", _ok, roles=frozenset({"KING"})),)), "roles must be among"),
        (
            Plugin("p", actions=(Action("A", "x", _ok, parameters=(Parameter("n", schema={"type": 12}),)),)),
            "invalid JSON schema",
        ),
    ],
)
def test_invalid_plugins_are_refused_clearly(plugin: object, mentions: str) -> None:
    with pytest.raises(InvalidArgument) as failure:
        validate_plugin(plugin, "test")
    assert mentions in failure.value.message


def test_plugins_by_dotted_path_and_by_entry_point(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(ROOT / "examples" / "notes_plugin"))
    notes = load_plugin("parley_notes:notes_plugin")
    assert notes.name == "notes"
    assert load_plugin("parley_notes.notes_plugin") is notes
    with pytest.raises(InvalidArgument, match="cannot import"):
        load_plugin("no_such_module:plugin")
    with pytest.raises(InvalidArgument, match="unknown plugin 'nothing'"):
        resolve_plugins(["nothing"], builtins={"basic_capabilities": basic_capabilities}, installed={})

    dist = tmp_path / "parley_notes_demo-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: parley-notes-demo\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[parley.plugins]\nnotes = parley_notes:notes_plugin\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    installed = discover_plugins()
    assert installed["notes"] is notes
    chosen = resolve_plugins(
        ["basic_capabilities", "notes"],
        builtins={"basic_capabilities": basic_capabilities},
        installed=installed,
    )
    assert [p.name for p in chosen] == ["basic_capabilities", "notes"]
