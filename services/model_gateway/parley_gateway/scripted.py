"""The deterministic ``scripted`` provider: rules map a prompt to a ``<response>``.

A rule is ``{match: <regex>, text: <template>, actions: [..], thought: .., latency_ms: ..}``.
The first rule whose regex is found in the prompt wins; ``{name}`` placeholders
in ``text`` take the regex's named groups. Without rules, the built-in rule
answers the prompt's current message with a friendly echo.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import json
import math
import re
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from xml.sax.saxutils import escape

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from parley_platform.logging import get_logger

from . import errors
from .batching import scripted_batch_answer
from .provider import Chunk, Completion, Embeddings, ProviderRequest, estimate_tokens

log = get_logger(__name__)


class Rule(BaseModel):
    model_config = ConfigDict(extra="forbid")

    match: str
    text: str = ""
    actions: list[str] = Field(default_factory=lambda: ["REPLY"])
    thought: str = ""
    raw: str | None = None  # answer exactly this text instead of a <response> block
    latency_ms: float | None = Field(default=None, ge=0, le=60_000)
    # When streamed: the pause before each word-sized piece (a slow model, for streaming tests).
    chunk_delay_ms: float = Field(default=0, ge=0, le=60_000)

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
        raise errors.SCRIPTED_RULES_INVALID(
            f"cannot read scripted rules {path.name}: {type(exc).__name__}"
        ) from exc
    items = data.get("rules") if isinstance(data, dict) else data
    if not isinstance(items, list):
        raise errors.SCRIPTED_RULES_INVALID(f"{path.name}: expected a list of rules (or {{rules: [...]}})")
    rules = []
    for index, item in enumerate(items):
        try:
            rules.append(Rule.model_validate(item))
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"])
            raise errors.SCRIPTED_RULES_INVALID(
                f"{path.name}: rule {index} field {where}: {first['msg']}"
            ) from exc
    return rules


_PLACE = re.compile(r"\{(\w+)\}")


def template_format(template: str, pattern: re.Pattern[str]) -> str:
    """``template`` as a ``str.format`` string, built once per rule: a ``{name}`` naming one of the
    pattern's groups is a place for what the group matched (empty when it matched nothing); every
    other brace is literal text (JSON answers)."""
    pieces = _PLACE.split(template)  # text, name, text, name, ..., text
    out = []
    for index, piece in enumerate(pieces):
        if index % 2 and piece in pattern.groupindex:
            out.append(f"{{{piece}}}")
        else:
            literal = f"{{{piece}}}" if index % 2 else piece
            out.append(literal.replace("{", "{{").replace("}", "}}"))
    return "".join(out)


@dataclass
class ScriptedProvider:
    rules: list[Rule] = field(default_factory=list)
    latency_ms: float = 0.0
    name: str = "scripted"
    model: str = "scripted-v1"
    cancelled: int = 0  # streams closed before their end (their caller went away)
    _compiled: list[tuple[re.Pattern[str], Rule]] = field(init=False)

    def __post_init__(self) -> None:
        self._compiled = [(re.compile(r.match), r) for r in self.rules]
        self._builtin = [(re.compile(r.match), r) for r in (ECHO_RULE, FALLBACK_RULE)]
        # Each rule's answer (its raw text, else its reply text) as a format string of its groups.
        self._formats = {
            id(rule): template_format(rule.text if rule.raw is None else rule.raw, pattern)
            for pattern, rule in [*self._compiled, *self._builtin]
        }
        # Each rule's <response> up to its text, escaped once (the zero-latency model's own cost
        # would otherwise count as the gateway's in bench/model_gateway.py).
        self._heads = {
            id(rule): f"<response><thought>{escape(rule.thought)}</thought>"
            f"<actions>{escape(','.join(rule.actions))}</actions><text>"
            for rule in [*self.rules, ECHO_RULE, FALLBACK_RULE]
        }

    def model_for(self, model_type: str) -> str:
        return self.model

    def _answer(self, prompt: str) -> tuple[str, float]:
        text, latency, _ = self._answer_rule(prompt)
        return text, latency

    def _answer_rule(self, prompt: str) -> tuple[str, float, Rule | None]:
        for pattern, rule in self._compiled:
            found = pattern.search(prompt)
            if found is not None:
                return self._render(rule, found), self._latency(rule), rule
        batch = scripted_batch_answer(prompt)
        if batch is not None:
            return batch, self.latency_ms, None
        for pattern, rule in self._builtin:
            found = pattern.search(prompt)
            if found is not None:
                return self._render(rule, found), self._latency(rule), rule
        raise AssertionError("the fallback rule matches every prompt")

    def _latency(self, rule: Rule) -> float:
        return self.latency_ms if rule.latency_ms is None else rule.latency_ms

    def _render(self, rule: Rule, found: re.Match[str]) -> str:
        text = self._formats[id(rule)].format_map(found.groupdict(""))
        if rule.raw is not None:
            return text
        return f"{self._heads[id(rule)]}{escape(text)}</text></response>"

    async def generate(self, request: ProviderRequest) -> Completion:
        # The rules see the prompt as the caller wrote it; ordering for caches is a provider concern.
        text, latency = self._answer(request.prompt)
        if latency > 0:
            await asyncio.sleep(latency / 1000)
        return Completion(
            text=text,
            input_tokens=request.estimated_input_tokens(),
            output_tokens=estimate_tokens(text),
            finish_reason="stop",
        )

    async def stream(self, request: ProviderRequest) -> AsyncIterator[Chunk | Completion]:
        _, _, rule = self._answer_rule(request.prompt)
        delay = rule.chunk_delay_ms / 1000 if rule is not None else 0.0
        completion = await self.generate(request)
        # Word-sized pieces, so streaming clients see more than one chunk.
        pieces = re.findall(r"\S+\s*|\s+", completion.text)
        sent = 0
        try:
            for piece in pieces:
                if delay:
                    await asyncio.sleep(delay)
                yield Chunk(piece)
                sent += 1
        except (asyncio.CancelledError, GeneratorExit):
            self.cancelled += 1
            log.info("scripted stream cancelled", sent=sent, of=len(pieces))
            raise
        yield completion

    async def close(self) -> None:
        return None


HASH_DIMENSION = 384
WORD = re.compile(r"\w+")


@dataclass
class ScriptedEmbedder:
    """Deterministic vectors from a hash of each word: no semantics, same dimension as the local model.

    Texts sharing words get similar vectors, which is enough for tests of storage and ranking plumbing.
    """

    name: str = "scripted"
    model: str = "scripted-hash-384"
    dimension: int = HASH_DIMENSION

    async def embed(self, texts: Sequence[str], *, timeout: float) -> Embeddings:
        return Embeddings(
            vectors=[hash_vector(t, self.dimension) for t in texts],
            input_tokens=sum(estimate_tokens(t) for t in texts),
            model=self.model,
            dimension=self.dimension,
        )

    async def close(self) -> None:
        return None


def hash_vector(text: str, dimension: int) -> list[float]:
    """Each word adds ±1 at a place its hash picks; the vector is then scaled to length 1. Only the
    few places the words touched are summed and scaled: the scripted model stands for one that
    answers at once, so its own work should not weigh in what a benchmark measures."""
    touched: dict[int, float] = {}
    for word in WORD.findall(text.lower()) or [text]:
        index, sign = _place(word, dimension)
        touched[index] = touched.get(index, 0.0) + sign
    norm = math.sqrt(sum(v * v for v in touched.values())) or 1.0
    vector = [0.0] * dimension
    for index, value in touched.items():
        vector[index] = value / norm
    return vector


@functools.lru_cache(maxsize=65536)
def _place(word: str, dimension: int) -> tuple[int, float]:
    """Where a word adds to a hash vector, and whether it adds 1 or -1."""
    digest = hashlib.blake2b(word.encode(), digest_size=8).digest()
    return int.from_bytes(digest[:4], "little") % dimension, 1.0 if digest[4] & 1 else -1.0
