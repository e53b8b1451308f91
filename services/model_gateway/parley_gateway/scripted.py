"""The deterministic ``scripted`` provider: rules map a prompt to a ``<response>``.

A rule is ``{match: <regex>, text: <template>, actions: [..], thought: .., latency_ms: ..}``.
The first rule whose regex is found in the prompt wins; ``{name}`` placeholders
in ``text`` take the regex's named groups. Without rules, the built-in rule
answers the prompt's current message with a friendly echo.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from xml.sax.saxutils import escape

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from parley_platform.errors import InvalidArgument

from .provider import Completion, Embeddings, ProviderRequest


class Rule(BaseModel):
    model_config = ConfigDict(extra="forbid")

    match: str
    text: str = ""
    actions: list[str] = Field(default_factory=lambda: ["REPLY"])
    thought: str = ""
    raw: str | None = None  # answer exactly this text instead of a <response> block
    latency_ms: float | None = Field(default=None, ge=0, le=60_000)

    @field_validator("match")
    @classmethod
    def _compiles(cls, value: str) -> str:
        try:
            re.compile(value)
        except re.error as exc:
            raise ValueError(f"not a valid regular expression: {exc}") from exc
        return value


# Matches the runtime's "# Current message\n<speaker>: <text>" section.
ECHO_RULE = Rule(
    match=r"(?s)# Current message\n[^\n:]*: (?P<message>.*?)\s*$",
    text="You said: {message}",
    thought="The user said something; I echo it back kindly.",
)
FALLBACK_RULE = Rule(match=r"(?s).*", text="Hello! I'm here and listening.", thought="No message found.")


def load_rules(path: Path) -> list[Rule]:
    try:
        text = path.read_text()
        data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (OSError, ValueError, yaml.YAMLError) as exc:
        raise InvalidArgument(
            f"cannot read scripted rules {path.name}: {type(exc).__name__}", code="SCRIPTED_RULES_INVALID"
        ) from exc
    items = data.get("rules") if isinstance(data, dict) else data
    if not isinstance(items, list):
        raise InvalidArgument(
            f"{path.name}: expected a list of rules (or {{rules: [...]}})", code="SCRIPTED_RULES_INVALID"
        )
    rules = []
    for index, item in enumerate(items):
        try:
            rules.append(Rule.model_validate(item))
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"])
            raise InvalidArgument(
                f"{path.name}: rule {index} field {where}: {first['msg']}", code="SCRIPTED_RULES_INVALID"
            ) from exc
    return rules


def _fill(template: str, groups: dict[str, str | None]) -> str:
    """Put the rule's named groups in ``{name}`` places; other braces stay as written (JSON answers)."""

    def value(match: re.Match[str]) -> str:
        name = match.group(1)
        return (groups.get(name) or "") if name in groups else match.group(0)

    return re.sub(r"\{(\w+)\}", value, template)


class _Missing(dict[str, Any]):
    def __missing__(self, key: str) -> str:
        return ""


@dataclass
class ScriptedProvider:
    rules: list[Rule] = field(default_factory=list)
    latency_ms: float = 0.0
    name: str = "scripted"
    model: str = "scripted-v1"
    _compiled: list[tuple[re.Pattern[str], Rule]] = field(init=False)

    def __post_init__(self) -> None:
        self._compiled = [(re.compile(r.match), r) for r in [*self.rules, ECHO_RULE, FALLBACK_RULE]]

    async def generate(self, request: ProviderRequest) -> Completion:
        prompt = request.prompt
        for pattern, rule in self._compiled:
            found = pattern.search(prompt)
            if found is None:
                continue
            latency = self.latency_ms if rule.latency_ms is None else rule.latency_ms
            if latency > 0:
                await asyncio.sleep(latency / 1000)
            if rule.raw is not None:
                text = _fill(rule.raw, found.groupdict())
            else:
                reply = _fill(rule.text, found.groupdict())
                text = (
                    f"<response><thought>{escape(rule.thought)}</thought>"
                    f"<actions>{escape(','.join(rule.actions))}</actions>"
                    f"<text>{escape(reply)}</text></response>"
                )
            return Completion(
                text=text, input_tokens=_tokens(prompt), output_tokens=_tokens(text), finish_reason="stop"
            )
        raise AssertionError("the fallback rule matches every prompt")


class HashingEmbedder:
    """Deterministic embeddings without a model: words hashed into a fixed number of buckets,
    L2-normalised. Texts sharing words are close, so search behaves sensibly in tests and benchmarks."""

    name = "scripted"
    model = "hashing-384"
    dimension = 384

    async def embed(self, texts: list[str]) -> Embeddings:
        return Embeddings([self._vector(t) for t in texts], self.model, sum(_tokens(t) for t in texts))

    def _vector(self, text: str) -> list[float]:
        vector = [0.0] * self.dimension
        for word in re.findall(r"\w+", text.lower()):
            digest = hashlib.blake2b(word.encode(), digest_size=8).digest()
            bucket = int.from_bytes(digest[:4], "big") % self.dimension
            vector[bucket] += 1.0 if digest[4] & 1 else -1.0
        norm = math.sqrt(sum(v * v for v in vector))
        return [v / norm for v in vector] if norm else vector


def _tokens(text: str) -> int:
    """A rough token count (about four characters per token), for usage accounting."""
    return max(1, len(text) // 4)
