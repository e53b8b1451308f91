"""Custom actions as ordinary actions of each agent's catalog, kept in step across replicas.

Where definitions come from, in order of precedence: the character's ``customActions``, the
operator's config file (``PARLEY_CUSTOM_ACTIONS_FILE``, for every agent), and the ones registered
live through the operator API, which are stored in ``runtime.custom_action``. Only enabled ones
become actions.

Replicas stay in step with a version check per turn, not a broadcast: every change bumps the
agent's row in ``runtime.custom_action_revision`` in the same statement, and each turn's ingest
statement reads that row (a primary-key lookup inside the statement the turn makes anyway; other
deliveries, such as confirmation events, read it with a statement of their own) and the replica
reloads the agent's definitions when it moved. A broadcast would be missed by a
replica that is reconnecting and would race the next message; the check gives read-after-write
across replicas: a turn that starts after ``AddCustomAction`` returned sees the action on every
replica.
"""

from __future__ import annotations

import uuid
import weakref
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from parley_platform.consumer import Delivery
from parley_platform.logging import get_logger

from .. import errors
from ..custom.definitions import CustomActionDef
from ..custom.executor import Executor, TestResult
from ..plugins.arguments import coerce_params, missing_required, schema_errors
from ..plugins.catalog import Catalog
from ..sdk import Action, ActionResult, Callback, Content, Parameter, Plugin, Tag, TurnContext
from .custom_store import CustomActionStore
from .directory import AgentDirectory, AgentInfo

log = get_logger(__name__)

PLUGIN_NAME = "custom_actions"
SOURCES = ("character", "config", "api")


@dataclass(frozen=True)
class Listed:
    definition: CustomActionDef
    source: str  # character, config or api


async def try_definition(
    executor: Executor,
    definition: CustomActionDef,
    raw: Mapping[str, object],
    setting: Callable[[str], object | None] | None = None,
) -> TestResult:
    """Run a definition once without registering it, its parameters checked like a turn's."""
    action = to_action(definition, executor)
    params = coerce_params(action, raw)
    missing = missing_required(action, params)
    if missing:
        return TestResult(False, f"missing: [{', '.join(missing)}]")
    problems = schema_errors(action, params)
    if problems:
        return TestResult(False, "; ".join(problems))
    return await executor.run(definition, params, setting)


def to_action(definition: CustomActionDef, executor: Executor) -> Action:
    """The definition as an ordinary action: listed to the model, parameters validated by the turn."""
    data = {"customAction": definition.id, "handler": definition.handler.type}

    async def handler(ctx: TurnContext, params: dict[str, Any], callback: Callback) -> ActionResult:
        result = await executor.run(definition, params, ctx.services.get_setting)
        if not result.ok:
            return ActionResult(False, text=result.output, data=data, error=result.output)
        if result.output.strip():
            await callback(Content(text=result.output, actions=(definition.name,)))
        return ActionResult(True, text=result.output, data=data)

    return Action(
        name=definition.name,
        description=definition.description,
        handler=handler,
        similes=tuple(definition.similes),
        parameters=tuple(
            Parameter(p.name, p.description, p.required, dict(p.json_schema)) for p in definition.parameters
        ),
        tags=frozenset({Tag.CUSTOM}),
        capabilities=frozenset({definition.handler.type}),
    )


class CustomActionRegistry:
    def __init__(
        self,
        store: CustomActionStore,
        directory: AgentDirectory,
        executor: Executor,
        config: Sequence[CustomActionDef] = (),
    ) -> None:
        self.store = store
        self.directory = directory
        self.executor = executor
        self.config = list(config)
        self._live: dict[uuid.UUID, tuple[int, list[CustomActionDef]]] = {}
        self._applied: dict[uuid.UUID, tuple[weakref.ref[AgentInfo], int]] = {}

    # -- keeping catalogs current ------------------------------------------------------------------

    def before_turns(
        self, handle: Callable[[Delivery], Awaitable[None]], agent_token: int = 2
    ) -> Callable[[Delivery], Awaitable[None]]:
        """``handle`` preceded by the revision check of the delivery's agent, whose id is the
        subject's token at ``agent_token`` (``<ns>.inbound.<agent>.<source>``, ``<ns>.self.<agent>``,
        ``<ns>.events.<agent>.<type>``)."""

        async def checked(delivery: Delivery) -> None:
            tokens = delivery.subject.split(".")
            try:
                agent_id: uuid.UUID | None = uuid.UUID(tokens[agent_token])
            except (ValueError, IndexError):
                agent_id = None
            if agent_id is not None:
                await self.refresh(agent_id)
            await handle(delivery)

        return checked

    async def refresh(self, agent_id: uuid.UUID, revision: int | None = None) -> AgentInfo | None:
        """The agent with its catalog at the current revision of its custom actions, or at
        ``revision`` when the caller read it already (a turn's ingest statement does)."""
        agent = self.directory.agents.get(str(agent_id)) or await self.directory.reload(str(agent_id))
        if agent is None:
            return None
        if revision is None:
            revision = await self.store.revision(agent_id)
        cached = self._live.get(agent_id)
        if cached is None or cached[0] != revision:
            revision, stored = await self.store.list(agent_id)
            self._live[agent_id] = (revision, [s.definition for s in stored])
        applied = self._applied.get(agent_id)
        if applied is None or applied[0]() is not agent or applied[1] != self._live[agent_id][0]:
            self.apply(agent)
        return agent

    def definitions(self, agent: AgentInfo) -> list[Listed]:
        """Every definition of the agent, enabled or not, by source; the first of a name wins."""
        found: list[Listed] = []
        names: set[str] = set()
        ids: set[str] = set()
        sources: list[tuple[str, Sequence[CustomActionDef]]] = [
            ("character", agent.character.custom_actions),
            ("config", self.config),
            ("api", self._live.get(agent.id, (0, []))[1]),
        ]
        for source, definitions in sources:
            for definition in definitions:
                if definition.name in names or definition.id in ids:
                    continue
                names.add(definition.name)
                ids.add(definition.id)
                found.append(Listed(definition, source))
        return found

    def apply(self, agent: AgentInfo) -> None:
        base = [p for p in agent.catalog.plugins if p.name != PLUGIN_NAME]
        taken = {a.name for p in base for a in p.actions}
        actions = []
        for listed in self.definitions(agent):
            definition = listed.definition
            if not definition.enabled:
                continue
            if definition.name in taken:
                log.warning(
                    "custom action shadows a plugin action; left out",
                    agent_id=str(agent.id),
                    action=definition.name,
                )
                continue
            actions.append(to_action(definition, self.executor))
        catalog = Catalog([*base, Plugin(PLUGIN_NAME, "custom actions", actions=tuple(actions))])
        agent.catalog = catalog
        revision = self._live.get(agent.id, (0, []))[0]
        self._applied[agent.id] = (weakref.ref(agent), revision)

    # -- the operator's changes --------------------------------------------------------------------

    async def add(self, agent: AgentInfo, definition: CustomActionDef) -> Listed:
        await self.refresh(agent.id)
        plugin_actions = {
            a.name: p.name for p in agent.catalog.plugins if p.name != PLUGIN_NAME for a in p.actions
        }
        if definition.name in plugin_actions:
            raise errors.CUSTOM_ACTION_NAME_TAKEN(
                f"name: {definition.name} is an action of the plugin {plugin_actions[definition.name]}"
            )
        for listed in self.definitions(agent):
            if listed.source == "api":
                continue
            for key in ("id", "name"):
                if getattr(listed.definition, key) == getattr(definition, key):
                    raise errors.CUSTOM_ACTION_NAME_TAKEN(
                        f"{key}: {getattr(definition, key)} is already defined by the {listed.source}",
                        hint="the character and the config file are changed where they are written",
                    )
        refusal = self.executor.disabled(definition)
        if refusal is not None:
            raise errors.CUSTOM_ACTION_HANDLER_DISABLED(f"handler.type: {refusal}")
        stored, _ = await self.store.upsert(agent.id, definition)
        await self.refresh(agent.id)
        return Listed(stored.definition, "api")

    async def remove(self, agent: AgentInfo, action_id: str) -> None:
        if await self.store.delete(agent.id, action_id) is None:
            others = [
                listed.source for listed in self.definitions(agent) if listed.definition.id == action_id
            ]
            hint = (
                f"it is defined by the {others[0]}, where it has to be removed"
                if others
                else "list them with `parley actions list`"
            )
            raise errors.CUSTOM_ACTION_NOT_FOUND(
                f"no custom action {action_id[:128]!r} registered through the API", hint=hint
            )
        await self.refresh(agent.id)
