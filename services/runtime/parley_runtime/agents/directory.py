"""The agents a runtime replica serves: character, plugins, secrets, all resolved once."""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field

from parley_clients.pairing import dm_policy

from .. import errors
from ..agent_settings import get_setting, setting_bool
from ..character import Character, parse_character
from ..plugins.builtin import BUILTIN_PLUGINS
from ..plugins.catalog import Catalog
from ..plugins.loading import discover_plugins, resolve_plugins
from ..plugins.settings import plugin_settings
from ..records import StoredAgent
from ..sdk import Plugin
from ..secrets import Redactor, SecretBox
from ..store import RuntimeStore


@dataclass
class AgentInfo:
    id: uuid.UUID
    character: Character
    catalog: Catalog = field(init=False)
    plugin_settings: dict[str, dict[str, object]] = field(init=False)
    enabled: bool = True
    host_settings: Mapping[str, object] = field(default_factory=dict)
    redactor: Redactor = field(init=False)

    def __post_init__(self) -> None:
        for key, value in self.character.settings.items():
            if key == "DM_POLICY" or key.startswith("DM_POLICY_"):
                dm_policy(value, f"settings.{key}")
        self.catalog = Catalog(plugins_for(self.character))
        self.redactor = Redactor(v for v in self.character.secrets.values() if isinstance(v, str))
        # Each plugin's declared settings, checked now: a missing or invalid one refuses the agent.
        self.plugin_settings = {p.name: plugin_settings(p, self.setting) for p in self.catalog.plugins}

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


def agent_from_record(
    stored: StoredAgent, secrets: Mapping[str, str], host_settings: Mapping[str, object]
) -> AgentInfo:
    character = parse_character({**stored.character, "secrets": dict(secrets)}, f"agent {stored.name}")
    return AgentInfo(stored.id, character, enabled=stored.enabled, host_settings=host_settings)


class AgentDirectory:
    """The agents this replica serves, kept in step with the database and the other replicas.

    Character files are loaded at start-up; the operator API adds, updates, enables and
    disables agents at run time. A change is written to the database, then announced on
    ``<ns>.runtime.agents.changed`` so every replica reloads that agent. A replica that
    missed the announcement finds an unknown agent in the database before giving up on it.
    """

    def __init__(self, store: RuntimeStore, box: SecretBox, host_settings: Mapping[str, object]) -> None:
        self.store = store
        self.box = box
        self.host_settings = host_settings
        self.agents: dict[str, AgentInfo] = {}
        self._announce: Callable[[str], Awaitable[None]] | None = None
        self._loaded: list[Callable[[AgentInfo], Awaitable[None]]] = []

    def connect(self, announce: Callable[[str], Awaitable[None]]) -> None:
        self._announce = announce

    def on_loaded(self, listener: Callable[[AgentInfo], Awaitable[None]]) -> None:
        """Called with every agent this replica loads or reloads from now on."""
        self._loaded.append(listener)

    async def _serve(self, agent: AgentInfo) -> AgentInfo:
        self.agents[str(agent.id)] = agent
        for listener in self._loaded:
            await listener(agent)
        return agent

    def get(self, ref: str) -> AgentInfo | None:
        agent = self.agents.get(ref)
        if agent is None:
            agent = next((a for a in self.agents.values() if a.character.name == ref), None)
        return agent

    async def find(self, ref: str) -> AgentInfo | None:
        """By id or name, from memory, else from the database."""
        return self.get(ref) or await self.reload(ref)

    async def require(self, ref: str) -> AgentInfo:
        """The agent a request names (by id or name), or the error that says it does not exist."""
        if not ref:
            raise errors.AGENT_REQUIRED("agent_id is required (an agent id or name)")
        agent = await self.find(ref)
        if agent is None:
            raise errors.AGENT_NOT_FOUND(f"no agent {ref[:100]!r}")
        return agent

    async def save(self, character: Character) -> AgentInfo:
        """Validate (plugins included), store with secrets encrypted, serve, and tell the other replicas."""
        agent = AgentInfo(
            character.agent_id, character, enabled=character.enabled, host_settings=self.host_settings
        )
        await self.store.upsert_agent(
            character.agent_id, character.name, character.document(), character.enabled
        )
        await self.store.store_secrets(
            character.agent_id,
            {
                name: self.box.encrypt(value, name=self._secret_name(character.agent_id, name))
                for name, value in character.secrets.items()
            },
        )
        await self._serve(agent)
        await self._changed(str(character.agent_id))
        return agent

    async def set_enabled(self, agent: AgentInfo, enabled: bool) -> AgentInfo:
        await self.store.set_agent_enabled(agent.id, enabled)
        agent.enabled = enabled
        await self._changed(str(agent.id))
        return agent

    async def reload(self, ref: str) -> AgentInfo | None:
        try:
            agent_id: uuid.UUID | None = uuid.UUID(ref)
        except ValueError:
            agent_id = None
        stored = await self.store.get_agent(agent_id, None if agent_id else ref)
        if stored is None:
            return None
        secrets = {
            name: self.box.decrypt(ciphertext, name=self._secret_name(stored.id, name))
            for name, ciphertext in (await self.store.list_secrets(stored.id)).items()
        }
        return await self._serve(agent_from_record(stored, secrets, self.host_settings))

    async def on_changed(self, agent_id: str) -> None:
        await self.reload(agent_id)

    async def announce(self, agent_id: str) -> None:
        """Tell every replica (this one too) to reload the agent: something it reads changed."""
        await self._changed(agent_id)

    async def _changed(self, agent_id: str) -> None:
        if self._announce is not None:
            await self._announce(agent_id)

    @staticmethod
    def _secret_name(agent_id: uuid.UUID, name: str) -> str:
        return f"{agent_id}/{name}"
