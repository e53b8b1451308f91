"""Plugins: what an agent can do (actions), know (providers) and learn (evaluators).

A plugin is a plain Python object (usually a ``Plugin``) found through the
``parley.plugins`` entry-point group or a dotted path (``package.module:attr``
or ``package.module.attr``) in the character's ``plugins`` list. Handlers get a
``TurnContext`` with everything they may touch; they never see protobuf, SQL
or NATS.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import TYPE_CHECKING, Any

from parley_platform.errors import InvalidArgument

if TYPE_CHECKING:
    from .context import TurnContext

ENTRY_POINT_GROUP = "parley.plugins"
ACTION_NAME = re.compile(r"^[A-Z][A-Z0-9]*(_[A-Z0-9]+)*$")
ROLES = ("OWNER", "ADMIN", "MEMBER", "GUEST", "NONE")


@dataclass(frozen=True)
class Content:
    """Something the agent says. Without a target it goes to the room of the turn."""

    text: str
    actions: tuple[str, ...] = ()
    thought: str = ""
    target_channel: str = ""  # another channel of the same connector (SEND_MESSAGE)
    attachments: tuple[Mapping[str, str], ...] = ()


@dataclass
class ActionResult:
    success: bool
    text: str = ""
    values: dict[str, Any] = field(default_factory=dict)
    data: dict[str, Any] = field(default_factory=dict)
    error: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "success": self.success,
            "text": self.text,
            "values": self.values,
            "data": self.data,
            "error": self.error,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ActionResult:
        return cls(
            bool(data.get("success")),
            str(data.get("text", "")),
            dict(data.get("values") or {}),
            dict(data.get("data") or {}),
            data.get("error"),
        )


@dataclass(frozen=True)
class ProviderResult:
    text: str = ""
    values: Mapping[str, Any] = field(default_factory=dict)
    data: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Parameter:
    name: str
    description: str = ""
    required: bool = False
    schema: Mapping[str, Any] = field(default_factory=lambda: {"type": "string"})
    aliases: tuple[str, ...] = ()


Callback = Callable[[Content], Awaitable[None]]
ActionHandler = Callable[["TurnContext", dict[str, Any], Callback], Awaitable[ActionResult | None]]
Validator = Callable[["TurnContext"], Awaitable[bool]]


@dataclass(frozen=True)
class Action:
    name: str
    description: str
    handler: ActionHandler
    similes: tuple[str, ...] = ()
    parameters: tuple[Parameter, ...] = ()
    examples: tuple[str, ...] = ()
    # `confirm`: needs a human decision first; `effect:idempotent`: safe to run twice;
    # `capability:*`: what it touches, for policy.
    tags: frozenset[str] = frozenset()
    private: bool = False  # only on autonomous turns
    roles: frozenset[str] | None = None  # participant roles allowed to trigger it; None: anyone
    validate: Validator | None = None
    allow_empty_arrays: frozenset[str] = frozenset()

    @property
    def idempotent(self) -> bool:
        return "effect:idempotent" in self.tags

    @property
    def needs_confirmation(self) -> bool:
        return "confirm" in self.tags


@dataclass(frozen=True)
class Provider:
    name: str
    get: Callable[[TurnContext], Awaitable[ProviderResult]]
    description: str = ""
    position: int = 0
    dynamic: bool = False  # only when the model asks for it
    private: bool = False  # never listed to the model


@dataclass(frozen=True)
class Evaluator:
    name: str
    handler: Callable[[TurnContext], Awaitable[ActionResult | None]]
    description: str = ""
    validate: Validator | None = None


@dataclass(frozen=True)
class Plugin:
    name: str
    description: str = ""
    actions: tuple[Action, ...] = ()
    providers: tuple[Provider, ...] = ()
    evaluators: tuple[Evaluator, ...] = ()
    services: tuple[Any, ...] = ()
    events: Mapping[str, Callable[..., Awaitable[None]]] = field(default_factory=dict)
    config: Mapping[str, Any] = field(default_factory=dict)


def validate_plugin(plugin: object, origin: str) -> Plugin:
    """Check a loaded object is a usable plugin; errors name the plugin and the offending part."""
    if not isinstance(plugin, Plugin):
        raise InvalidArgument(
            f"plugin {origin}: expected a parley_runtime.plugin.Plugin, got {type(plugin).__name__}",
            code="PLUGIN_INVALID",
        )
    where = f"plugin {plugin.name or origin!r}"
    if not plugin.name.strip():
        raise InvalidArgument(f"plugin {origin}: name must not be empty", code="PLUGIN_INVALID")
    seen: set[str] = set()
    for action in plugin.actions:
        if not isinstance(action, Action):
            raise InvalidArgument(f"{where}: actions must be Action objects", code="PLUGIN_INVALID")
        if not ACTION_NAME.match(action.name):
            raise InvalidArgument(
                f"{where}: action name {action.name!r} is not SCREAMING_SNAKE_CASE", code="PLUGIN_INVALID"
            )
        if action.name in seen:
            raise InvalidArgument(f"{where}: action {action.name} is declared twice", code="PLUGIN_INVALID")
        seen.add(action.name)
        if not callable(action.handler):
            raise InvalidArgument(f"{where}: action {action.name} has no handler", code="PLUGIN_INVALID")
        if action.roles is not None and not set(action.roles) <= set(ROLES):
            raise InvalidArgument(
                f"{where}: action {action.name} roles must be among {', '.join(ROLES)}", code="PLUGIN_INVALID"
            )
        names = [p.name for p in action.parameters]
        if len(set(names)) != len(names):
            raise InvalidArgument(
                f"{where}: action {action.name} repeats a parameter name", code="PLUGIN_INVALID"
            )
        for parameter in action.parameters:
            _check_schema(where, action.name, parameter)
    for provider in plugin.providers:
        if not isinstance(provider, Provider) or not provider.name.strip() or not callable(provider.get):
            raise InvalidArgument(
                f"{where}: providers must be Provider objects with a name and get()", code="PLUGIN_INVALID"
            )
    for evaluator in plugin.evaluators:
        if not isinstance(evaluator, Evaluator) or not callable(evaluator.handler):
            raise InvalidArgument(
                f"{where}: evaluators must be Evaluator objects with a handler", code="PLUGIN_INVALID"
            )
    return plugin


def _check_schema(where: str, action: str, parameter: Parameter) -> None:
    from jsonschema import Draft202012Validator
    from jsonschema.exceptions import SchemaError

    try:
        Draft202012Validator.check_schema(dict(parameter.schema))
    except SchemaError as exc:
        raise InvalidArgument(
            f"{where}: action {action} parameter {parameter.name}: invalid JSON schema ({exc.message})",
            code="PLUGIN_INVALID",
        ) from exc


def load_plugin(ref: str) -> Plugin:
    """Load a plugin by dotted path, ``package.module:attribute`` or ``package.module.attribute``."""
    module_name, _, attribute = ref.partition(":")
    if not attribute:
        module_name, _, attribute = ref.rpartition(".")
    if not module_name or not attribute:
        raise InvalidArgument(f"plugin {ref!r}: expected 'package.module:attribute'", code="PLUGIN_NOT_FOUND")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise InvalidArgument(
            f"plugin {ref!r}: cannot import {module_name} ({exc})",
            code="PLUGIN_NOT_FOUND",
            hint="is the package installed in the runtime's environment?",
        ) from exc
    try:
        found = getattr(module, attribute)
    except AttributeError:
        raise InvalidArgument(
            f"plugin {ref!r}: {module_name} has no attribute {attribute}", code="PLUGIN_NOT_FOUND"
        ) from None
    return validate_plugin(found() if callable(found) and not isinstance(found, Plugin) else found, ref)


def discover_plugins() -> dict[str, Plugin]:
    """Plugins installed in the environment under the ``parley.plugins`` entry-point group, by name."""
    found: dict[str, Plugin] = {}
    for entry in entry_points(group=ENTRY_POINT_GROUP):
        loaded = entry.load()
        plugin = validate_plugin(
            loaded() if callable(loaded) and not isinstance(loaded, Plugin) else loaded,
            f"entry point {entry.name}",
        )
        found[entry.name] = plugin
    return found


def resolve_plugins(
    refs: Iterable[str], *, builtins: Mapping[str, Plugin], installed: Mapping[str, Plugin] | None = None
) -> list[Plugin]:
    """The plugins a character asks for: built-in names, installed entry-point names or dotted paths."""
    plugins: list[Plugin] = []
    names: set[str] = set()
    for ref in refs:
        if ref in builtins:
            plugin = builtins[ref]
        elif installed is not None and ref in installed:
            plugin = installed[ref]
        elif "." in ref or ":" in ref:
            plugin = load_plugin(ref)
        else:
            known = sorted({*builtins, *(installed or {})})
            raise InvalidArgument(
                f"unknown plugin {ref!r}",
                code="PLUGIN_NOT_FOUND",
                hint=f"known plugins: {', '.join(known)}; or give a dotted path",
            )
        if plugin.name not in names:
            names.add(plugin.name)
            plugins.append(plugin)
    return plugins
