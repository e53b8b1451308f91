"""The action catalog and everything between a planned action and its handler:
lookup by name or simile, parameter coercion and JSON-schema validation,
``resolve_action_args`` (one extraction call when required parameters are
missing) and sub-action dispatch."""

from __future__ import annotations

import contextlib
import json
import math
import re
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from jsonschema import Draft202012Validator

from parley_platform.errors import InvalidArgument

from .context import TurnContext
from .plugin import Action, Evaluator, Parameter, Plugin, Provider

SUBACTION_KEYS = ("action", "subaction", "op", "operation", "verb")
CONFIDENCE_FLOOR = 0.5
EXTRACTION_HISTORY_LINES = 8
H = TypeVar("H")


class Catalog:
    """Every action, provider and evaluator of an agent's plugins."""

    def __init__(self, plugins: Iterable[Plugin]) -> None:
        self.plugins = list(plugins)
        self.actions: dict[str, Action] = {}
        self._by_alias: dict[str, Action] = {}
        providers: dict[str, Provider] = {}
        self.evaluators: list[Evaluator] = []
        for plugin in self.plugins:
            for action in plugin.actions:
                if action.name in self.actions:
                    raise InvalidArgument(
                        f"action {action.name} is defined by two plugins", code="PLUGIN_CONFLICT"
                    )
                self.actions[action.name] = action
            for provider in plugin.providers:
                providers[provider.name] = provider
            self.evaluators.extend(plugin.evaluators)
        for action in self.actions.values():
            self._by_alias[action.name.lower()] = action
        for action in self.actions.values():
            for simile in action.similes:
                self._by_alias.setdefault(simile.lower(), action)
        self.providers = sorted(providers.values(), key=lambda p: (p.position, p.name))

    def find(self, name: str) -> Action | None:
        return self._by_alias.get(name.strip().lower())

    def provider(self, name: str) -> Provider | None:
        wanted = name.strip().upper()
        return next((p for p in self.providers if p.name.upper() == wanted), None)

    async def available(self, ctx: TurnContext) -> list[Action]:
        """The actions this actor may use now: private ones on autonomous turns, role gates, validate()."""
        found = []
        for action in self.actions.values():
            if permission_error(action, ctx) is None and (
                action.validate is None or await action.validate(ctx)
            ):
                found.append(action)
        return found


def permission_error(action: Action, ctx: TurnContext) -> str | None:
    if action.private and not ctx.is_autonomous:
        return f"{action.name} is private: only autonomous turns may use it"
    if action.roles is not None and ctx.role not in action.roles:
        return f"{action.name} needs the role {' or '.join(sorted(action.roles))}; the sender is {ctx.role}"
    return None


def describe(actions: Sequence[Action]) -> str:
    """The action catalog as the model sees it."""
    lines = []
    for action in sorted(actions, key=lambda a: a.name):
        line = f"- {action.name}: {action.description}"
        if action.similes:
            line += f" (also: {', '.join(action.similes)})"
        if action.parameters:
            params = ", ".join(
                f"{p.name}{'' if p.required else '?'}: {p.schema.get('type', 'string')}"
                for p in action.parameters
            )
            line += f" params: {params}"
        lines.append(line)
    return "\n".join(lines)


def _parameter_of(action: Action, key: str) -> Parameter | None:
    wanted = key.strip().lower()
    for parameter in action.parameters:
        if parameter.name.lower() == wanted or wanted in (a.lower() for a in parameter.aliases):
            return parameter
    return None


def coerce_params(action: Action, raw: Mapping[str, object]) -> dict[str, Any]:
    """Map aliases to parameter names; decode JSON text where the schema wants a non-string."""
    params: dict[str, Any] = {}
    for key, value in raw.items():
        parameter = _parameter_of(action, key)
        name = parameter.name if parameter else key
        if (
            parameter is not None
            and isinstance(value, str)
            and parameter.schema.get("type") not in (None, "string")
        ):
            with contextlib.suppress(ValueError):  # left as text: schema validation reports it
                value = json.loads(value)
        params[name] = value
    return params


def _present(value: object, allow_empty_array: bool) -> bool:
    if value is None:
        return False
    if isinstance(value, str):
        return bool(value.strip())
    if isinstance(value, (list, tuple)):
        return bool(value) or allow_empty_array
    return True


def missing_required(action: Action, params: Mapping[str, Any]) -> list[str]:
    return [
        p.name
        for p in action.parameters
        if p.required and not _present(params.get(p.name), p.name in action.allow_empty_arrays)
    ]


def schema_errors(action: Action, params: Mapping[str, Any]) -> list[str]:
    errors = []
    for parameter in action.parameters:
        if parameter.name not in params or params[parameter.name] is None:
            continue
        validator = Draft202012Validator(dict(parameter.schema))
        for error in validator.iter_errors(params[parameter.name]):
            errors.append(f"{parameter.name}: {error.message}")
    return errors


@dataclass
class Resolution:
    params: dict[str, Any]
    missing: list[str] = field(default_factory=list)
    clarification: str | None = None
    confidence: float | None = None
    extraction_calls: int = 0


def parse_confidence(value: object) -> float | None:
    """A strict JSON number (not a string, not a bool), clamped to [0, 1]; anything else is None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return min(1.0, max(0.0, float(value)))


_JSON_OBJECT = re.compile(r"\{.*\}", re.DOTALL)


def _json_object(text: str) -> dict[str, Any] | None:
    candidate = text.strip()
    if candidate.startswith("```"):
        candidate = candidate.strip("`").removeprefix("json").strip()
    for attempt in (candidate, *(m.group(0) for m in _JSON_OBJECT.finditer(candidate))):
        try:
            value = json.loads(attempt)
        except ValueError:
            continue
        if isinstance(value, dict):
            return value
    return None


def extraction_prompt(action: Action, intent: str, recent: Sequence[str], missing: Sequence[str]) -> str:
    spec = "\n".join(
        f"- {p.name} ({'required' if p.required else 'optional'}): {p.description} "
        f"schema={json.dumps(dict(p.schema), sort_keys=True)}"
        for p in action.parameters
    )
    lines = "\n".join(recent[-EXTRACTION_HISTORY_LINES:])
    return (
        f"Extract the parameters of the action {action.name} from the conversation.\n"
        f"Parameters:\n{spec}\nMissing so far: {', '.join(missing)}\n\n"
        f"Conversation (most recent last):\n{lines}\n\nIntent: {intent}\n\n"
        'Answer with one JSON object only: {"<param>": <value>, ..., "confidence": <number 0..1>}.'
    )


async def resolve_action_args(
    action: Action,
    planner: Mapping[str, object],
    *,
    extract: Callable[[str], Awaitable[str]],
    intent: str,
    recent: Sequence[str],
) -> Resolution:
    """Planner params are trusted when every required one is present; otherwise one JSON extraction
    call (plus one repair retry when its answer is not a JSON object). Planner values win."""
    params = coerce_params(action, planner)
    missing = missing_required(action, params)
    if not missing:
        return Resolution(params)
    prompt = extraction_prompt(action, intent, recent, missing)
    answer = await extract(prompt)
    calls = 1
    extracted = _json_object(answer)
    if extracted is None:
        answer = await extract(
            prompt + f"\n\nYour previous answer was not a JSON object:\n{answer[:500]}\n"
            "Answer again with the JSON object only."
        )
        calls = 2
        extracted = _json_object(answer) or {}
    confidence = parse_confidence(extracted.pop("confidence", None))
    merged = {
        **coerce_params(action, extracted),
        **{k: v for k, v in params.items() if _present(v, k in action.allow_empty_arrays)},
    }
    still_missing = missing_required(action, merged)
    clarification = None
    if confidence is not None and confidence < CONFIDENCE_FLOOR:
        clarification = (
            f"I'm not sure I understood what to do for {action.name}. "
            f"Could you tell me {', '.join(still_missing or missing)}?"
        )
    return Resolution(merged, still_missing, clarification, confidence, calls)


class UnknownSubaction(InvalidArgument):
    default_code = "UNKNOWN_SUBACTION"


def normalise_subaction(value: str) -> str:
    snake = re.sub(r"(?<=[a-z0-9])([A-Z])", r"_\1", value.strip())
    return re.sub(r"[^a-z0-9]+", "_", snake.lower()).strip("_")


def dispatch_subaction(params: Mapping[str, Any], handlers: Mapping[str, H]) -> tuple[str, H]:
    """Pick a sub-action by the first dispatch key present (action, subaction, op, operation, verb)."""
    for key in SUBACTION_KEYS:
        value = params.get(key)
        if isinstance(value, str) and value.strip():
            name = normalise_subaction(value)
            if name in handlers:
                return name, handlers[name]
            raise UnknownSubaction(f"unknown sub-action {name!r}; known: {', '.join(sorted(handlers))}")
    raise UnknownSubaction(f"no sub-action given (one of {', '.join(SUBACTION_KEYS)})")
