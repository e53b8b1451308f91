"""An agent's catalog: every action, provider and evaluator of its plugins, and how the model
sees the actions."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from .. import errors
from ..sdk import Action, Evaluator, Plugin, Provider, TurnContext


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
                    raise errors.PLUGIN_CONFLICT(f"action {action.name} is defined by two plugins")
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


MAX_EXAMPLES = 2  # per action: enough to show the form, few enough to keep the prompt short


def describe(actions: Sequence[Action]) -> str:
    """The action catalog as the model sees it, each action's examples under it."""
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
        for example in action.examples[:MAX_EXAMPLES]:
            lines.append("  Example:\n" + "\n".join(f"    {part}" for part in example.splitlines()))
    return "\n".join(lines)
