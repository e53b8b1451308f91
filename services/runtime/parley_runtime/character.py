"""Characters: the validated document that defines an agent."""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, field_validator

from parley_clients.character_files import inline_knowledge

from . import errors, ids
from .custom.definitions import CustomActionDef
from .eliza import normalize
from .mcp_servers import SERVER_NAME, McpServerDef


class MessageExample(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    text: str
    actions: list[str] = Field(default_factory=list)


class KnowledgeItem(BaseModel):
    """A text of the character's knowledge: it becomes one of the agent's documents."""

    model_config = ConfigDict(extra="forbid")
    text: str = Field(min_length=1, max_length=512_000)
    path: str = ""  # where it came from, for a file entry
    shared: bool = False  # elizaOS's flag, kept; the document is global to the agent either way


class Character(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    name: str = Field(min_length=1, max_length=100, pattern=r"^[A-Za-z0-9][A-Za-z0-9 _.-]*$")
    id: uuid.UUID | None = None
    username: str = ""
    system: str = ""
    bio: list[str] = Field(default_factory=list)
    lore: list[str] = Field(default_factory=list)
    style: dict[str, list[str]] = Field(default_factory=dict)
    topics: list[str] = Field(default_factory=list)
    adjectives: list[str] = Field(default_factory=list)
    message_examples: list[list[MessageExample]] = Field(default_factory=list, alias="messageExamples")
    post_examples: list[str] = Field(default_factory=list, alias="postExamples")
    knowledge: list[KnowledgeItem] = Field(default_factory=list)
    settings: dict[str, Any] = Field(default_factory=dict)
    secrets: dict[str, str] = Field(default_factory=dict)
    plugins: list[str] = Field(default_factory=list)
    templates: dict[str, str] = Field(default_factory=dict)
    clients: list[str] = Field(default_factory=list)  # elizaOS 0.x; Parley's connectors serve them
    model_provider: str = Field("", alias="modelProvider")  # kept; the model gateway decides
    eliza_plugins: list[str] = Field(default_factory=list, alias="elizaPlugins")  # as written
    extra: dict[str, Any] = Field(default_factory=dict)  # keys Parley does not use, kept
    # Actions with an http, shell or code handler (parley_runtime/custom); only enabled ones are used.
    custom_actions: list[CustomActionDef] = Field(default_factory=list, alias="customActions")
    # MCP servers whose tools become actions (parley_runtime/mcp, docs/mcp.md), by name.
    mcp_servers: dict[str, McpServerDef] = Field(default_factory=dict, alias="mcpServers")
    enabled: bool = True
    _warnings: list[str] = PrivateAttr(default_factory=list)

    @property
    def warnings(self) -> list[str]:
        """What loading the document left out or kept unused (elizaOS plugins, keys, templates)."""
        return list(self._warnings)

    @field_validator("mcp_servers")
    @classmethod
    def _server_names(cls, value: dict[str, McpServerDef]) -> dict[str, McpServerDef]:
        for name in value:
            if not SERVER_NAME.match(name):
                raise ValueError(f"{name[:40]!r}: a letter, then up to 31 letters, digits, '_' or '-'")
        return value

    @property
    def agent_id(self) -> uuid.UUID:
        return self.id or ids.agent_id(self.name)

    def document(self) -> dict[str, Any]:
        """The character as stored, without its secrets (they are stored encrypted, elsewhere)."""
        return self.model_dump(mode="json", by_alias=True, exclude={"secrets"}, exclude_defaults=True)


def _describe(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors():
        where = ".".join(str(p) for p in err["loc"]) or "(document)"
        parts.append(f"{where}: {err['msg']}")
    return "; ".join(parts)


def parse_character(data: Any, origin: str = "character", extra_warnings: Sequence[str] = ()) -> Character:
    if not isinstance(data, dict):
        raise errors.CHARACTER_INVALID(f"{origin}: a character must be a mapping")
    data, warnings = normalize(data)
    try:
        character = Character.model_validate(data)
    except ValidationError as exc:
        raise errors.CHARACTER_INVALID(
            f"{origin}: {_describe(exc)}", hint="see characters/default.yaml for a valid example"
        ) from exc
    character._warnings = [*extra_warnings, *warnings]
    return character


def load_character_file(path: Path) -> Character:
    try:
        text = path.read_text()
        data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (OSError, ValueError, yaml.YAMLError) as exc:
        raise errors.CHARACTER_INVALID(
            f"{path.name}: cannot read character file ({type(exc).__name__})"
        ) from exc
    # knowledge {path}/{directory} entries: read here, next to the file, never from a request
    warnings = inline_knowledge(data, path.parent) if isinstance(data, dict) else []
    return parse_character(data, path.name, warnings)


def load_characters(directory: Path) -> list[Character]:
    files = sorted(p for p in directory.glob("*") if p.suffix in {".yaml", ".yml", ".json"})
    characters = [load_character_file(p) for p in files]
    names = [c.name for c in characters]
    duplicates = {n for n in names if names.count(n) > 1}
    if duplicates:
        raise errors.CHARACTER_INVALID(
            f"characters in {directory} share names: {', '.join(sorted(duplicates))}"
        )
    return characters
