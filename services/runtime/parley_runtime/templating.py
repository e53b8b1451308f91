"""elizaOS's ``{{placeholder}}`` templates: a character's own prompts and its example names.

elizaOS writes examples with ``{{user1}}``/``{{name1}}`` for the people and ``{{agentName}}`` /
``{{name}}`` / ``{{char}}`` for the agent, and lets a character replace a prompt with a template of
its own (``templates.messageHandlerTemplate`` ...). Here both are filled in: the people by fixed
example names (the same on every replica, so prompts stay cacheable), the agent by its name, and
a template's other placeholders by what the character and the turn's state hold.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .character import Character

PLACEHOLDER = re.compile(r"\{\{\s*([A-Za-z][A-Za-z0-9_]*)\s*\}\}")
EXAMPLE_PEOPLE = ("Alex", "Sam", "Jordan", "Riley", "Casey", "Morgan", "Taylor", "Jamie", "Robin")
AGENT_KEYS = frozenset({"agentName", "name", "char", "charName", "characterName"})
PERSON = re.compile(r"(?:user|name)(\d+)")


def person(number: int) -> str:
    return EXAMPLE_PEOPLE[(number - 1) % len(EXAMPLE_PEOPLE)]


def fill(text: str, values: Callable[[str], str | None]) -> str:
    """Each ``{{key}}`` replaced by ``values(key)``; None leaves the placeholder as it is."""

    def one(found: re.Match[str]) -> str:
        value = values(found[1])
        return found[0] if value is None else value

    return PLACEHOLDER.sub(one, text)


def names(text: str, agent_name: str) -> str:
    """The agent's and the example people's placeholders filled in; any other left alone."""

    def value(key: str) -> str | None:
        if key in AGENT_KEYS:
            return agent_name
        numbered = PERSON.fullmatch(key)
        return person(int(numbered[1])) if numbered else None

    return fill(text, value)


def example_lines(character: Character, limit: int | None = None) -> list[str]:
    """The character's message examples, one conversation per item, names filled in."""
    groups = character.message_examples if limit is None else character.message_examples[:limit]
    out = []
    for group in groups:
        lines = []
        for message in group:
            line = f"{message.name}: {message.text}"
            if message.actions:
                line += f" (actions: {', '.join(message.actions)})"
            lines.append(line)
        out.append(names("\n".join(lines), character.name))
    return out


def character_values(character: Character) -> dict[str, str]:
    """What a template may say about the character: stable for the agent, never per message."""
    c = character
    style_all = c.style.get("all", [])
    values = {
        "bio": " ".join(c.bio),
        "lore": " ".join(c.lore),
        "system": c.system,
        "topics": ", ".join(c.topics),
        "topic": c.topics[0] if c.topics else "",
        "adjectives": ", ".join(c.adjectives),
        "adjective": c.adjectives[0] if c.adjectives else "",
        "messageDirections": "\n".join([*style_all, *c.style.get("chat", [])]),
        "postDirections": "\n".join([*style_all, *c.style.get("post", [])]),
        "characterMessageExamples": "\n\n".join(example_lines(c)),
        "characterPostExamples": "\n".join(c.post_examples),
    }
    values["messageExamples"] = values["characterMessageExamples"]
    values["examples"] = values["characterMessageExamples"]
    values["postExamples"] = values["characterPostExamples"]
    return {k: names(v, c.name) for k, v in values.items()}


def render(template: str, character: Character, values: Mapping[str, str]) -> str:
    """A template filled in: the agent, the example people, ``values``, the character; else empty."""
    own = character_values(character)

    def value(key: str) -> str:
        if key in AGENT_KEYS:
            return character.name
        if key in values:
            return values[key]
        if key in own:
            return own[key]
        numbered = PERSON.fullmatch(key)
        return person(int(numbered[1])) if numbered else ""

    return fill(template, value)


def split_at_first(template: str, unstable: Callable[[str], bool]) -> tuple[str, str]:
    """The template before its first placeholder for which ``unstable`` holds, and the rest."""
    for found in PLACEHOLDER.finditer(template):
        if unstable(found[1]):
            return template[: found.start()], template[found.start() :]
    return template, ""
