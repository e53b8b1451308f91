"""The agents a runtime replica serves: character, plugins, secrets, all resolved once."""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .actions import Catalog
from .agent_settings import get_setting, setting_bool
from .basic import basic_capabilities
from .character import Character
from .plugin import Plugin, discover_plugins, resolve_plugins
from .secrets import Redactor

BUILTIN_PLUGINS: dict[str, Plugin] = {"basic_capabilities": basic_capabilities}


@dataclass
class AgentInfo:
    id: uuid.UUID
    character: Character
    catalog: Catalog = field(init=False)
    enabled: bool = True
    host_settings: Mapping[str, object] = field(default_factory=dict)
    redactor: Redactor = field(init=False)

    def __post_init__(self) -> None:
        self.catalog = Catalog(plugins_for(self.character))
        self.redactor = Redactor(v for v in self.character.secrets.values() if isinstance(v, str))

    def setting(self, key: str) -> object | None:
        """In the spec's order: secrets, settings, .extra, .secrets, env, host; never os.environ."""
        return get_setting(
            key,
            secrets=self.character.secrets,
            settings=self.character.settings,
            host_settings=self.host_settings,
        )

    def flag(self, key: str, default: bool = False) -> bool:
        value = setting_bool(self.setting(key))
        return default if value is None else value


_installed: dict[str, Plugin] | None = None


def plugins_for(character: Character) -> list[Plugin]:
    """basic_capabilities first, then what the character lists (names or dotted paths)."""
    global _installed
    refs = ["basic_capabilities", *character.plugins]
    needs_discovery = any(r not in BUILTIN_PLUGINS and "." not in r and ":" not in r for r in refs)
    if needs_discovery and _installed is None:
        _installed = discover_plugins()
    return resolve_plugins(refs, builtins=BUILTIN_PLUGINS, installed=_installed)


def agent_from_row(
    row: Mapping[str, Any], secrets: Mapping[str, str], host_settings: Mapping[str, object]
) -> AgentInfo:
    from .character import parse_character

    character = parse_character({**row["character"], "secrets": dict(secrets)}, f"agent {row['name']}")
    return AgentInfo(row["id"], character, enabled=row["enabled"], host_settings=host_settings)
