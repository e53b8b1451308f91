"""The prompt batcher's pure logic: its knobs, sections, packing, the packed prompt and its answer.

Many small, structurally similar prompts (evaluators, start-up questions,
autonomy) are packed into fewer model calls. A drain takes the due sections of
one affinity; per agent and priority, isolated sections get a call each and the
rest are sorted by estimated tokens and packed greedily under the call's token
limit and field cap. Each field travels namespaced as ``<section>__<field>`` and
is split back per section; a missing or invalid field is retried, then the
section's fallback is used.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any
from xml.sax.saxutils import escape

from parley_platform.errors import ParleyError

from . import errors
from .provider import estimate_tokens

# --- knobs ------------------------------------------------------------------------------------------

ENV_PREFIX = "PROMPT_BATCHER_"
_INTEGER = re.compile(r"[0-9]+", re.ASCII)
_FRACTION = re.compile(r"(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)", re.ASCII)
_MAX_INTEGER = 2_147_483_647


@dataclass(frozen=True)
class BatcherConfig:
    batch_size: int = 8
    max_drain_interval_ms: int = 30_000
    max_sections_per_call: int = 8
    packing_density: float = 0.85
    max_tokens_per_call: int = 24_000
    max_parallel_calls: int = 2
    model_separation: float = 1.0


_INTEGER_KEYS = {
    "BATCH_SIZE": "batch_size",
    "MAX_DRAIN_INTERVAL_MS": "max_drain_interval_ms",
    "MAX_SECTIONS_PER_CALL": "max_sections_per_call",
    "MAX_TOKENS_PER_CALL": "max_tokens_per_call",
    "MAX_PARALLEL_CALLS": "max_parallel_calls",
}
_FRACTION_KEYS = {"PACKING_DENSITY": "packing_density", "MODEL_SEPARATION": "model_separation"}


def _invalid(key: str, expected: str) -> ParleyError:
    # The value is not echoed: configuration may sit next to secrets, and the key says where to look.
    return errors.PROMPT_BATCHER_CONFIG_INVALID(
        f"{ENV_PREFIX}{key} must be {expected}",
        hint=f"fix or unset {ENV_PREFIX}{key} (blank means the default)",
    )


def load_config(environ: Mapping[str, str]) -> BatcherConfig:
    """Read the ``PROMPT_BATCHER_*`` knobs: blank means the default, anything else must be valid."""
    values: dict[str, int | float] = {}
    for key, attr in _INTEGER_KEYS.items():
        raw = environ.get(ENV_PREFIX + key, "").strip()
        if not raw:
            continue
        if not _INTEGER.fullmatch(raw) or not 1 <= int(raw) <= _MAX_INTEGER:
            raise _invalid(key, f"a positive decimal integer (1 to {_MAX_INTEGER})")
        values[attr] = int(raw)
    for key, attr in _FRACTION_KEYS.items():
        raw = environ.get(ENV_PREFIX + key, "").strip()
        if not raw:
            continue
        if not _FRACTION.fullmatch(raw):
            raise _invalid(key, "a decimal number from 0 through 1")
        number = float(raw)
        if not 0.0 <= number <= 1.0:
            raise _invalid(key, "a decimal number from 0 through 1")
        values[attr] = number
    return BatcherConfig(**values)  # type: ignore[arg-type]


PRIORITY_FACTOR = {"immediate": 0.65, "normal": 0.85, "background": 1.0}
PRIORITY_ORDER = {"immediate": 0, "normal": 1, "background": 2}


def token_limit(config: BatcherConfig, priority: str) -> int:
    """``max(512, floor(MAX_TOKENS_PER_CALL × (0.35 + 0.65 × PACKING_DENSITY) × factor(priority)))``."""
    scaled = config.max_tokens_per_call * (0.35 + 0.65 * config.packing_density) * PRIORITY_FACTOR[priority]
    return max(512, math.floor(scaled))


# --- sections ---------------------------------------------------------------------------------------

SECTION_ID = re.compile(r"[A-Za-z][A-Za-z0-9_-]{0,63}", re.ASCII)
FIELD_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_]{0,63}", re.ASCII)
AFFINITY = re.compile(r"(?:default|autonomy|init|room:[A-Za-z0-9_.:-]{1,128})", re.ASCII)
TIERS = ("TEXT_SMALL", "TEXT_LARGE", "OBJECT_SMALL", "OBJECT_LARGE")
LARGE_TIERS = frozenset({"TEXT_LARGE", "OBJECT_LARGE"})
FREQUENCIES = ("once", "per_drain", "recurring")
MAX_PROMPT_CHARS = 64 * 1024
MAX_FIELDS = 32
MAX_VALUE_CHARS = 4096


@dataclass(frozen=True)
class SchemaField:
    name: str
    description: str = ""
    optional: bool = False
    pattern: str = ""


@dataclass(frozen=True)
class Section:
    id: str
    agent_id: str
    affinity: str
    prompt: str
    fields: tuple[SchemaField, ...]
    priority: str = "normal"
    tier: str = "TEXT_SMALL"
    isolated: bool = False
    fallback: Mapping[str, str] = field(default_factory=dict)
    frequency: str = "once"
    min_cycle_ms: int = 0
    max_retries: int = 0
    owner: str = ""
    system: str = ""

    @property
    def estimated_tokens(self) -> int:
        described = sum(
            estimate_tokens(f.description) + 2 * estimate_tokens(self.key(f.name)) for f in self.fields
        )
        return estimate_tokens(self.prompt) + described + 8

    def key(self, field_name: str) -> str:
        return f"{self.id}__{field_name}"

    def to_spec(self) -> dict[str, Any]:
        """The section as JSON, as the store keeps it."""
        return {
            "id": self.id,
            "agent_id": self.agent_id,
            "affinity": self.affinity,
            "prompt": self.prompt,
            "fields": [
                {"name": f.name, "description": f.description, "optional": f.optional, "pattern": f.pattern}
                for f in self.fields
            ],
            "priority": self.priority,
            "tier": self.tier,
            "isolated": self.isolated,
            "fallback": dict(self.fallback),
            "frequency": self.frequency,
            "min_cycle_ms": self.min_cycle_ms,
            "max_retries": self.max_retries,
            "owner": self.owner,
            "system": self.system,
        }

    @classmethod
    def from_spec(cls, spec: Mapping[str, Any]) -> Section:
        return cls(
            id=spec["id"],
            agent_id=spec["agent_id"],
            affinity=spec["affinity"],
            prompt=spec["prompt"],
            fields=tuple(SchemaField(**f) for f in spec["fields"]),
            priority=spec["priority"],
            tier=spec["tier"],
            isolated=spec["isolated"],
            fallback=dict(spec["fallback"]),
            frequency=spec["frequency"],
            min_cycle_ms=spec["min_cycle_ms"],
            max_retries=spec["max_retries"],
            owner=spec["owner"],
            system=spec["system"],
        )


def validate_section(section: Section) -> Section:
    """Checks a section; every error names the field that is wrong."""

    def bad(path: str, what: str) -> ParleyError:
        return errors.INVALID_SECTION(f"section.{path} {what}")

    if not SECTION_ID.fullmatch(section.id):
        raise bad("id", "must match [A-Za-z][A-Za-z0-9_-]{0,63}")
    if "__" in section.id:
        raise bad("id", "must not contain '__' (it separates section and field names)")
    if not section.agent_id:
        raise bad("agent_id", "is required")
    if len(section.agent_id) > 128:
        raise bad("agent_id", "is over 128 characters")
    if not AFFINITY.fullmatch(section.affinity):
        raise bad("affinity", "must be default, autonomy, init or room:<id>")
    if not section.prompt.strip():
        raise bad("prompt", "is required")
    if len(section.prompt) > MAX_PROMPT_CHARS:
        raise bad("prompt", f"is over {MAX_PROMPT_CHARS} characters")
    if len(section.system) > MAX_PROMPT_CHARS:
        raise bad("system", f"is over {MAX_PROMPT_CHARS} characters")
    if not section.fields:
        raise bad("fields", "needs at least one field")
    if len(section.fields) > MAX_FIELDS:
        raise bad("fields", f"has more than {MAX_FIELDS} fields")
    seen: set[str] = set()
    for index, f in enumerate(section.fields):
        if not FIELD_NAME.fullmatch(f.name):
            raise bad(f"fields[{index}].name", "must match [A-Za-z][A-Za-z0-9_]{0,63}")
        if f.name in seen:
            raise bad(f"fields[{index}].name", "is a duplicate")
        seen.add(f.name)
        if len(f.description) > 2048:
            raise bad(f"fields[{index}].description", "is over 2048 characters")
        if f.pattern:
            try:
                re.compile(f.pattern)
            except re.error:
                raise bad(f"fields[{index}].pattern", "is not a valid regular expression") from None
    unknown = sorted(set(section.fallback) - seen)
    if unknown:
        raise bad("fallback", f"names fields the section does not have: {', '.join(unknown)[:200]}")
    if section.priority not in PRIORITY_FACTOR:
        raise bad("priority", "must be immediate, normal or background")
    if section.tier not in TIERS:
        raise bad("model_type", "must be one of " + ", ".join(TIERS))
    if section.frequency not in FREQUENCIES:
        raise bad("frequency", "must be once, per_drain or recurring")
    if section.frequency == "recurring" and not 1 <= section.min_cycle_ms <= 86_400_000:
        raise bad("min_cycle_ms", "must be from 1 to 86400000 for a recurring section")
    if section.frequency != "recurring" and section.min_cycle_ms != 0:
        raise bad("min_cycle_ms", "applies only to recurring sections")
    if not 0 <= section.max_retries <= 2:
        raise bad("max_retries", "must be 0, 1 or 2")
    if len(section.owner) > 128:
        raise bad("owner", "is over 128 characters")
    return section


# --- packing ----------------------------------------------------------------------------------------


@dataclass
class Call:
    """One model call carrying one or more sections."""

    agent_id: str
    priority: str
    tier: str
    sections: list[Section] = field(default_factory=list)
    tokens: int = 0
    limit: int = 0

    @property
    def field_count(self) -> int:
        return sum(len(s.fields) for s in self.sections)

    def fits(self, section: Section, max_fields: int) -> bool:
        return (
            self.tokens + section.estimated_tokens <= self.limit
            and self.field_count + len(section.fields) <= max_fields
        )

    def add(self, section: Section) -> None:
        self.sections.append(section)
        self.tokens += section.estimated_tokens


def _greedy(
    sections: list[Section], agent_id: str, priority: str, tier: str, config: BatcherConfig
) -> list[Call]:
    limit = token_limit(config, priority)
    calls: list[Call] = []
    # First-fit decreasing: the largest sections find a call first, the small ones fill the gaps.
    for section in sorted(sections, key=lambda s: (-s.estimated_tokens, s.id)):
        target = next((c for c in calls if c.fits(section, config.max_sections_per_call)), None)
        if target is None:
            target = Call(agent_id, priority, tier, limit=limit)
            calls.append(target)
        target.add(section)
    return calls


def pack(sections: Iterable[Section], config: BatcherConfig) -> list[Call]:
    """Group by agent and priority; isolated sections alone; the rest packed greedily.

    Tiers are kept apart when ``model_separation`` is 1. Below 1, a small-tier call may ride
    along in a large-tier call (run on the large tier) when it is filled no more than
    ``(1 - model_separation)`` of its token limit and the large call has room for it.
    """
    groups: dict[tuple[str, str], list[Section]] = {}
    for section in sections:
        groups.setdefault((section.agent_id, section.priority), []).append(section)
    calls: list[Call] = []
    for (agent_id, priority), members in sorted(
        groups.items(), key=lambda item: (PRIORITY_ORDER[item[0][1]], item[0][0])
    ):
        limit = token_limit(config, priority)
        for section in members:
            if section.isolated:
                call = Call(agent_id, priority, section.tier, limit=limit)
                call.add(section)
                calls.append(call)
        by_tier: dict[str, list[Section]] = {}
        for section in members:
            if not section.isolated:
                by_tier.setdefault(section.tier, []).append(section)
        packed = {
            tier: _greedy(items, agent_id, priority, tier, config) for tier, items in sorted(by_tier.items())
        }
        if config.model_separation < 1:
            _merge_tiers(packed, config, limit)
        for tier_calls in packed.values():
            calls.extend(tier_calls)
    return calls


def _merge_tiers(packed: dict[str, list[Call]], config: BatcherConfig, limit: int) -> None:
    threshold = (1 - config.model_separation) * limit
    large = [c for tier, cs in packed.items() if tier in LARGE_TIERS for c in cs]
    for tier in [t for t in packed if t not in LARGE_TIERS]:
        kept: list[Call] = []
        for small in packed[tier]:
            host = None
            if small.tokens <= threshold:
                host = next(
                    (
                        c
                        for c in large
                        if c.tokens + small.tokens <= c.limit
                        and c.field_count + small.field_count <= config.max_sections_per_call
                    ),
                    None,
                )
            if host is None:
                kept.append(small)
                continue
            for section in small.sections:
                host.add(section)
        packed[tier] = kept


# --- the packed prompt and its answer ---------------------------------------------------------------

BATCH_MARKER = "# Batched requests"
FIELD_LINE = re.compile(r"^- (?P<key>[A-Za-z][A-Za-z0-9_-]*__[A-Za-z][A-Za-z0-9_]*):", re.MULTILINE)


def call_keys(call: Call) -> list[str]:
    return [s.key(f.name) for s in call.sections for f in s.fields]


def build_prompt(call: Call) -> tuple[str, str]:
    """The (system, prompt) of a call: each section's request and its namespaced fields."""
    systems = [s.system.strip() for s in call.sections if s.system.strip()]
    system = "\n\n".join(dict.fromkeys(systems))
    parts = [f"{BATCH_MARKER}\nAnswer each request below independently. Fill in every field listed for it.\n"]
    for section in call.sections:
        lines = [f"\n## Request {section.id}\n{section.prompt.strip()}\nFields:"]
        for f in section.fields:
            description = " ".join(f.description.split()) or f.name
            lines.append(f"- {section.key(f.name)}: {description}" + (" (optional)" if f.optional else ""))
        parts.append("\n".join(lines) + "\n")
    keys = call_keys(call)
    example = "\n".join(f"  <{k}>...</{k}>" for k in keys)
    parts.append(
        "\n# Output format\nAnswer with exactly one XML block, one element per field in this order, "
        f"and nothing else:\n<response>\n{example}\n</response>\n"
    )
    return system, "".join(parts)


def _unescape(text: str) -> str:
    return (
        text.replace("&lt;", "<")
        .replace("&gt;", ">")
        .replace("&quot;", '"')
        .replace("&apos;", "'")
        .replace("&amp;", "&")
    )


def extract_fields(text: str, keys: Iterable[str]) -> dict[str, str]:
    """The value of each ``<key>…</key>`` element found (inside ``<response>`` when there is one)."""
    text = text[: 1024 * 1024]
    start = text.find("<response>")
    end = text.rfind("</response>")
    if 0 <= start < end:
        text = text[start + len("<response>") : end]
    found: dict[str, str] = {}
    for key in keys:
        opened = text.find(f"<{key}>")
        if opened < 0:
            continue
        value_start = opened + len(key) + 2
        closed = text.find(f"</{key}>", value_start)
        if closed < 0:
            continue
        found[key] = _unescape(text[value_start:closed].strip())[:MAX_VALUE_CHARS]
    return found


@dataclass(frozen=True)
class Outcome:
    """What one call gave a section: its fields, or why they cannot be used."""

    fields: dict[str, str]
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.error


def split_answer(section: Section, found: Mapping[str, str]) -> Outcome:
    values: dict[str, str] = {}
    for f in section.fields:
        value = found.get(section.key(f.name))
        if value is None or (not value and not f.optional):
            if f.optional:
                continue
            return Outcome({}, f"missing field {section.key(f.name)}")
        if f.pattern and value and re.fullmatch(f.pattern, value) is None:
            return Outcome({}, f"invalid field {section.key(f.name)}")
        values[f.name] = value
    return Outcome(values)


def scripted_batch_answer(prompt: str) -> str | None:
    """What the scripted model answers to a packed prompt: ``scripted`` for every field asked."""
    if BATCH_MARKER not in prompt:
        return None
    keys = list(dict.fromkeys(m.group("key") for m in FIELD_LINE.finditer(prompt)))
    body = "".join(f"<{k}>{escape('scripted')}</{k}>" for k in keys)
    return f"<response>{body}</response>"
