"""Between a planned action and its handler: parameter aliases and coercion, JSON-schema
validation, and ``resolve_action_args`` (one extraction call when required parameters are
missing)."""

from __future__ import annotations

import contextlib
import json
import math
import re
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from jsonschema import Draft202012Validator

from ..sdk import Action, Parameter

CONFIDENCE_FLOOR = 0.5
EXTRACTION_HISTORY_LINES = 8


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


JSON_OBJECT = re.compile(r"\{.*\}", re.DOTALL)


def json_object(text: str) -> dict[str, Any] | None:
    candidate = text.strip()
    if candidate.startswith("```"):
        candidate = candidate.strip("`").removeprefix("json").strip()
    for attempt in (candidate, *(m.group(0) for m in JSON_OBJECT.finditer(candidate))):
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
    extracted = json_object(answer)
    if extracted is None:
        answer = await extract(
            prompt + f"\n\nYour previous answer was not a JSON object:\n{answer[:500]}\n"
            "Answer again with the JSON object only."
        )
        calls = 2
        extracted = json_object(answer) or {}
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
