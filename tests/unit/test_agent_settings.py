from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from parley_platform.errors import InvalidArgument, Kind
from parley_platform.settings import Environment
from parley_runtime.agent_settings import (
    TRAJECTORY_LOGGING_VARIABLE,
    get_setting,
    setting_bool,
    setting_int,
    setting_list,
    trajectory_logging_enabled,
)

KEY = "MODEL_API_KEY"
LEVELS = ["secrets", "settings", "extra", "settings.secrets", "env", "host"]


def sources(present: Mapping[str, object]) -> dict[str, Any]:
    """The keyword arguments of get_setting, with KEY set at the named levels."""
    settings_map: dict[str, Any] = {"extra": {}, "secrets": {}, "env": {}}
    secrets: dict[str, str] = {}
    host: dict[str, object] = {}
    for level, value in present.items():
        if level == "secrets":
            assert isinstance(value, str)
            secrets[KEY] = value
        elif level == "settings":
            settings_map[KEY] = value
        elif level == "extra":
            settings_map["extra"][KEY] = value
        elif level == "settings.secrets":
            settings_map["secrets"][KEY] = value
        elif level == "env":
            settings_map["env"][KEY] = value
        elif level == "host":
            host[KEY] = value
    return {"secrets": secrets, "settings": settings_map, "host_settings": host}


# Each row sets KEY at one level and at every level below it: the highest level wins.
@pytest.mark.parametrize("winner", range(len(LEVELS)), ids=LEVELS)
def test_each_level_shadows_every_level_after_it(winner: int) -> None:
    present = {level: f"from-{level}" for level in LEVELS[winner:]}
    assert get_setting(KEY, **sources(present)) == f"from-{LEVELS[winner]}"


@pytest.mark.parametrize("level", LEVELS)
def test_each_level_alone_is_found(level: str) -> None:
    assert get_setting(KEY, **sources({level: f"from-{level}"})) == f"from-{level}"


@settings(max_examples=200, deadline=None)
@given(st.sets(st.sampled_from(LEVELS)))
def test_the_first_level_in_spec_order_wins(levels: set[str]) -> None:
    expected = next((f"from-{lv}" for lv in LEVELS if lv in levels), None)
    assert get_setting(KEY, **sources({lv: f"from-{lv}" for lv in levels})) == expected


def test_missing_everywhere_is_none() -> None:
    assert get_setting(KEY, secrets={}, settings={}, host_settings={}) is None
    assert get_setting(KEY, **sources({})) is None


@pytest.mark.parametrize("blank", ["", " ", "\t\n"])
@pytest.mark.parametrize("level", LEVELS[:-1])
def test_a_blank_string_counts_as_unset_and_falls_through(blank: str, level: str) -> None:
    assert get_setting(KEY, **sources({level: blank, "host": "from-host"})) == "from-host"
    assert get_setting(KEY, **sources({level: blank})) is None


@pytest.mark.parametrize("level", LEVELS[1:-1])
def test_none_counts_as_unset(level: str) -> None:
    assert get_setting(KEY, **sources({level: None, "host": "from-host"})) == "from-host"


@pytest.mark.parametrize("value", [False, 0, 0.0, [], {}, "false", "0"])
@pytest.mark.parametrize("level", LEVELS[1:-1])
def test_falsy_values_are_values_and_shadow_later_levels(value: object, level: str) -> None:
    found = get_setting(KEY, **sources({level: value, "host": True}))
    assert found == value
    assert type(found) is type(value)


def test_values_are_returned_as_stored() -> None:
    assert get_setting(KEY, **sources({"settings": "true"})) == "true"
    assert get_setting(KEY, **sources({"extra": 42})) == 42
    assert get_setting(KEY, **sources({"env": " padded "})) == " padded "
    nested = {"a": [1, 2]}
    assert get_setting(KEY, **sources({"host": nested})) is nested


@pytest.mark.parametrize("section", ["extra", "secrets", "env"])
@pytest.mark.parametrize("odd", ["a string", ["MODEL_API_KEY"], 7, None])
def test_a_section_that_is_not_a_mapping_is_skipped(section: str, odd: object) -> None:
    found = get_setting(KEY, secrets={}, settings={section: odd}, host_settings={KEY: "from-host"})
    assert found == "from-host"


def test_sections_are_looked_up_only_for_their_key() -> None:
    kwargs = sources({"extra": "x", "settings.secrets": "y", "env": "z"})
    assert get_setting("OTHER", **kwargs) is None
    assert get_setting("extra", **kwargs) == {KEY: "x"}  # a top-level key is a top-level key


def test_the_process_environment_is_never_read(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(KEY, "from-process-environment")
    monkeypatch.setenv("PARLEY_" + KEY, "from-process-environment")
    assert get_setting(KEY, secrets={}, settings={}, host_settings={}) is None
    assert get_setting(KEY, **sources({"host": ""})) is None
    assert get_setting(KEY, **sources({"host": "from-host"})) == "from-host"


# ---------------------------------------------------------------- setting_bool


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        *[(w, True) for w in ["true", "1", "yes", "on", "TRUE", "True", " yes ", "On\n", "\tON"]],
        *[(w, False) for w in ["false", "0", "no", "off", "FALSE", "No", " off ", "0 "]],
        (True, True),
        (False, False),
        (1, True),
        (0, False),
        *[(v, None) for v in ["", "  ", "maybe", "ture", "y", "n", "t", "f", "2", "-1", "enabled", "1.0"]],
        *[(v, None) for v in [None, 2, -1, 1.0, 0.0, [], ["true"], {"true": 1}, b"true"]],
    ],
)
def test_setting_bool(value: object, expected: bool | None) -> None:
    assert setting_bool(value) is expected


# ---------------------------------------------------------------- setting_int


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (4, 4),
        (0, 0),
        (-2, -2),
        ("4", 4),
        (" 12\n", 12),
        ("-3", -3),
        ("+5", 5),
        *[(v, None) for v in [True, False, None, "", "  ", "four", "1.5", "4 turns", 2.0, [4], {"n": 4}]],
    ],
)
def test_setting_int(value: object, expected: int | None) -> None:
    assert setting_int(value) == expected
    assert setting_int(value) is None or type(setting_int(value)) is int


# ---------------------------------------------------------------- setting_list


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("a,b,c", ["a", "b", "c"]),
        (" a , b ,c ", ["a", "b", "c"]),
        ("a,,b, ,", ["a", "b"]),
        ("single", ["single"]),
        ("", []),
        ("  ", []),
        (",,,", []),
        ("with space, inside", ["with space", "inside"]),
        (["a", "b"], ["a", "b"]),
        (["a, b", " c "], ["a, b", " c "]),  # a list is already split: items pass through
        ([1, True, None, 2.5], ["1", "True", "2.5"]),
        (("x", "y"), ["x", "y"]),
        ([], []),
        (None, []),
        (7, ["7"]),
        (False, ["False"]),
    ],
)
def test_setting_list(value: object, expected: list[str]) -> None:
    assert setting_list(value) == expected


def test_setting_list_returns_a_new_list() -> None:
    original = ["a", "b"]
    result = setting_list(original)
    assert result == original
    assert result is not original


# ---------------------------------------------------------------- trajectory logging

DEFAULT_ON = {"development": True, "test": False, "production": False}


@pytest.mark.parametrize("environment", sorted(DEFAULT_ON))
@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        (None, "default"),
        ("", "default"),
        ("  ", "default"),
        ("\t\n", "default"),
        ("true", True),
        ("1", True),
        ("yes", True),
        ("on", True),
        (" TRUE ", True),
        ("false", False),
        ("0", False),
        ("no", False),
        ("off", False),
        (" False ", False),
    ],
)
def test_trajectory_logging_rule(raw: str | None, expected: bool | str, environment: str) -> None:
    want = DEFAULT_ON[environment] if expected == "default" else expected
    assert trajectory_logging_enabled(raw, environment) is want


@pytest.mark.parametrize("environment", sorted(DEFAULT_ON))
@pytest.mark.parametrize("raw", ["garbage", "ture", "enable", "2", "-1", "y", "true!", "nope"])
def test_an_unrecognised_trajectory_value_is_a_start_up_error(raw: str, environment: str) -> None:
    with pytest.raises(InvalidArgument) as info:
        trajectory_logging_enabled(raw, environment)
    err = info.value
    assert err.code == "TRAJECTORY_LOGGING_INVALID"
    assert err.kind is Kind.INVALID_ARGUMENT
    assert TRAJECTORY_LOGGING_VARIABLE == "PARLEY_TRAJECTORY_LOGGING"
    assert TRAJECTORY_LOGGING_VARIABLE in err.message
    assert repr(raw) in err.message
    assert "true or false" in err.hint


def test_a_long_unrecognised_value_is_shown_truncated() -> None:
    with pytest.raises(InvalidArgument) as info:
        trajectory_logging_enabled("x" * 500, "production")
    assert "x" * 33 not in info.value.message


@pytest.mark.parametrize(
    ("environment", "expected"), [("staging", False), ("", False), ("Development", False)]
)
def test_an_unknown_environment_defaults_to_off(environment: str, expected: bool) -> None:
    assert trajectory_logging_enabled(None, environment) is expected
    assert trajectory_logging_enabled("true", environment) is True


def test_trajectory_logging_takes_the_settings_enum() -> None:
    assert trajectory_logging_enabled(None, Environment.DEVELOPMENT) is True
    assert trajectory_logging_enabled(None, Environment.TEST) is False
    assert trajectory_logging_enabled(None, Environment.PRODUCTION) is False
