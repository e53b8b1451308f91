"""A plugin's declared settings for one agent: read in the agent's ``get_setting`` order, converted
from strings where the schema wants a number, an integer or a boolean, and checked against the
schema. What is wrong names the plugin and the setting, never the value (it may be a secret)."""

from __future__ import annotations

from collections.abc import Callable, Mapping

from jsonschema import Draft202012Validator

from .. import errors
from ..agent_settings import setting_bool
from ..sdk import Plugin, Setting


def plugin_settings(plugin: Plugin, lookup: Callable[[str], object | None]) -> dict[str, object]:
    values: dict[str, object] = {}
    for setting in plugin.config:
        value = lookup(setting.name)
        if value is None:
            value = setting.default
        if value is None:
            if setting.required:
                what = setting.description or "no default"
                raise errors.PLUGIN_CONFIG_INVALID(
                    f"plugin {plugin.name}: setting {setting.name} is required ({what})"
                )
            continue
        value = _converted(setting, value)
        problem = next(iter(Draft202012Validator(dict(setting.schema)).iter_errors(value)), None)
        if problem is not None:
            raise errors.PLUGIN_CONFIG_INVALID(
                f"plugin {plugin.name}: setting {setting.name} does not match its schema"
                f" ({problem.validator}: {_expected(problem.validator_value)})"
            )
        values[setting.name] = value
    return values


def _converted(setting: Setting, value: object) -> object:
    if not isinstance(value, str):
        return value
    kind = setting.schema.get("type")
    text = value.strip()
    try:
        if kind == "integer":
            return int(text)
        if kind == "number":
            return float(text)
    except ValueError:
        return value
    if kind == "boolean":
        parsed = setting_bool(text)
        return value if parsed is None else parsed
    return value


def _expected(value: object) -> str:
    """What the schema wanted, without echoing the agent's value."""
    if isinstance(value, Mapping | list | tuple):
        return "see the plugin's declaration"
    return str(value)[:100]
