"""Finding plugins: built-in names, the ``parley.plugins`` entry-point group, or dotted paths
(``package.module:attr`` or ``package.module.attr``) in a character's ``plugins`` list, each
checked before an agent uses it (errors name the plugin and the offending part)."""

from __future__ import annotations

import importlib
import re
from collections.abc import Iterable, Mapping
from importlib.metadata import entry_points

from parley_platform.errors import ParleyError

from .. import errors
from ..names import ACTION_NAME, ROLES
from ..sdk import Action, Evaluator, Parameter, Plugin, Provider, Setting, Tag

ENTRY_POINT_GROUP = "parley.plugins"
SERVICE_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


def validate_plugin(plugin: object, origin: str) -> Plugin:
    """Check a loaded object is a usable plugin; errors name the plugin and the offending part."""
    if not isinstance(plugin, Plugin):
        raise errors.PLUGIN_INVALID(
            f"plugin {origin}: expected a parley_runtime.sdk.Plugin, got {type(plugin).__name__}"
        )
    where = f"plugin {plugin.name or origin!r}"
    if not plugin.name.strip():
        raise errors.PLUGIN_INVALID(f"plugin {origin}: name must not be empty")
    seen: set[str] = set()
    for action in plugin.actions:
        if not isinstance(action, Action):
            raise errors.PLUGIN_INVALID(f"{where}: actions must be Action objects")
        if not ACTION_NAME.match(action.name):
            raise errors.PLUGIN_INVALID(f"{where}: action name {action.name!r} is not SCREAMING_SNAKE_CASE")
        if action.name in seen:
            raise errors.PLUGIN_INVALID(f"{where}: action {action.name} is declared twice")
        seen.add(action.name)
        if not callable(action.handler):
            raise errors.PLUGIN_INVALID(f"{where}: action {action.name} has no handler")
        unknown = sorted(str(t) for t in action.tags if not isinstance(t, Tag))
        if unknown:
            raise errors.PLUGIN_INVALID(
                f"{where}: action {action.name} has unknown tags {unknown}",
                hint="tags are parley_runtime.sdk.Tag members; what an action touches goes in capabilities",
            )
        if action.roles is not None and not set(action.roles) <= set(ROLES):
            raise errors.PLUGIN_INVALID(
                f"{where}: action {action.name} roles must be among {', '.join(ROLES)}"
            )
        names = [p.name for p in action.parameters]
        if len(set(names)) != len(names):
            raise errors.PLUGIN_INVALID(f"{where}: action {action.name} repeats a parameter name")
        for parameter in action.parameters:
            _check_schema(where, action.name, parameter)
    for provider in plugin.providers:
        if not isinstance(provider, Provider) or not provider.name.strip() or not callable(provider.get):
            raise errors.PLUGIN_INVALID(f"{where}: providers must be Provider objects with a name and get()")
    for evaluator in plugin.evaluators:
        if not isinstance(evaluator, Evaluator) or not callable(evaluator.handler):
            raise errors.PLUGIN_INVALID(f"{where}: evaluators must be Evaluator objects with a handler")
    services = [getattr(service, "name", "") for service in plugin.services]
    for service in plugin.services:
        if not all(callable(getattr(service, m, None)) for m in ("start", "stop")):
            raise errors.PLUGIN_INVALID(f"{where}: services must have async start(run) and stop()")
        if not isinstance(getattr(service, "name", None), str) or not SERVICE_NAME.fullmatch(service.name):
            raise errors.PLUGIN_INVALID(f"{where}: a service name must be 1-64 letters, digits, '_' or '-'")
    if len(set(services)) != len(services):
        raise errors.PLUGIN_INVALID(f"{where}: two services have one name")
    for event, handlers in plugin.events.items():
        if not ACTION_NAME.match(event):
            raise errors.PLUGIN_INVALID(f"{where}: event {event!r} is not SCREAMING_SNAKE_CASE")
        if not isinstance(handlers, tuple) or not all(callable(h) for h in handlers):
            raise errors.PLUGIN_INVALID(f"{where}: the handlers of {event} must be a tuple of coroutines")
    settings = [setting.name for setting in plugin.config]
    if len(set(settings)) != len(settings):
        raise errors.PLUGIN_INVALID(f"{where}: a setting is declared twice")
    for setting in plugin.config:
        if not isinstance(setting, Setting) or not setting.name.strip():
            raise errors.PLUGIN_INVALID(f"{where}: config must be Setting objects with a name")
        _check_setting_schema(where, setting)
    if plugin.init is not None and not callable(plugin.init):
        raise errors.PLUGIN_INVALID(f"{where}: init must be a coroutine function taking the settings")
    if not all(isinstance(d, str) and d.strip() for d in plugin.dependencies):
        raise errors.PLUGIN_INVALID(f"{where}: dependencies must be plugin names")
    return plugin


def _check_setting_schema(where: str, setting: Setting) -> None:
    from jsonschema import Draft202012Validator
    from jsonschema.exceptions import SchemaError

    try:
        Draft202012Validator.check_schema(dict(setting.schema))
    except SchemaError as exc:
        raise errors.PLUGIN_INVALID(
            f"{where}: setting {setting.name}: invalid JSON schema ({exc.message})"
        ) from exc


def _check_schema(where: str, action: str, parameter: Parameter) -> None:
    from jsonschema import Draft202012Validator
    from jsonschema.exceptions import SchemaError

    try:
        Draft202012Validator.check_schema(dict(parameter.schema))
    except SchemaError as exc:
        raise errors.PLUGIN_INVALID(
            f"{where}: action {action} parameter {parameter.name}: invalid JSON schema ({exc.message})"
        ) from exc


def load_plugin(ref: str) -> Plugin:
    """Load a plugin by dotted path, ``package.module:attribute`` or ``package.module.attribute``."""
    module_name, _, attribute = ref.partition(":")
    if not attribute:
        module_name, _, attribute = ref.rpartition(".")
    if not module_name or not attribute:
        raise errors.PLUGIN_NOT_FOUND(f"plugin {ref!r}: expected 'package.module:attribute'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise errors.PLUGIN_NOT_FOUND(
            f"plugin {ref!r}: cannot import {module_name} ({exc})",
            hint="is the package installed in the runtime's environment?",
        ) from exc
    try:
        found = getattr(module, attribute)
    except AttributeError:
        raise errors.PLUGIN_NOT_FOUND(f"plugin {ref!r}: {module_name} has no attribute {attribute}") from None
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
    """The plugins a character asks for (built-in names, installed entry-point names or dotted
    paths) and the plugins they depend on, each after its dependencies (a cycle is refused)."""
    wanted: list[Plugin] = []
    for ref in refs:
        wanted.append(_resolve(ref, builtins, installed))
    by_name: dict[str, Plugin] = {}
    for plugin in wanted:
        by_name.setdefault(plugin.name, plugin)
    ordered: list[Plugin] = []
    state: dict[str, str] = {}  # visiting / done

    def visit(plugin: Plugin, path: tuple[str, ...]) -> None:
        if state.get(plugin.name) == "done":
            return
        if state.get(plugin.name) == "visiting":
            cycle = " -> ".join((*path[path.index(plugin.name) :], plugin.name))
            raise errors.PLUGIN_INVALID(f"plugin dependencies form a cycle: {cycle}")
        state[plugin.name] = "visiting"
        for name in plugin.dependencies:
            dependency = by_name.get(name)
            if dependency is None:
                try:
                    dependency = _resolve(name, builtins, installed)
                except ParleyError as exc:
                    if not errors.PLUGIN_NOT_FOUND.matches(exc):
                        raise
                    raise errors.PLUGIN_NOT_FOUND(
                        f"plugin {plugin.name!r} depends on {name!r}, which is not available ({exc})"
                    ) from None
                by_name[name] = dependency
            visit(dependency, (*path, plugin.name))
        state[plugin.name] = "done"
        ordered.append(plugin)

    for plugin in wanted:
        visit(by_name[plugin.name], ())
    return ordered


def _resolve(ref: str, builtins: Mapping[str, Plugin], installed: Mapping[str, Plugin] | None) -> Plugin:
    if ref in builtins:
        return builtins[ref]
    if installed is not None and ref in installed:
        return installed[ref]
    if "." in ref or ":" in ref:
        return load_plugin(ref)
    known = sorted({*builtins, *(installed or {})})
    raise errors.PLUGIN_NOT_FOUND(
        f"unknown plugin {ref!r}", hint=f"known plugins: {', '.join(known)}; or give a dotted path"
    )
