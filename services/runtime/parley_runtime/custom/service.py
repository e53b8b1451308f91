"""Wiring of custom actions into the runtime app: settings, the registry and the API's transports."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from parley_platform.consumer import Delivery
from parley_platform.logging import get_logger
from parley_platform.postgres import Database

from ..agents import AgentDirectory
from ..config import RuntimeSettings
from .api import CustomActionsApi
from .registry import CustomActionRegistry, CustomActionSettings, Executor, load_config_file
from .store import CustomActionStore

log = get_logger(__name__)


class CustomActionsService:
    def __init__(self, registry: CustomActionRegistry) -> None:
        self.registry = registry
        self.api = CustomActionsApi(registry.directory, registry)

    @classmethod
    def create(
        cls, settings: RuntimeSettings, db: Database, directory: AgentDirectory
    ) -> CustomActionsService:
        config = []
        if settings.custom_actions_file is not None:
            config = [d for d in load_config_file(settings.custom_actions_file) if d.enabled]
        executor = Executor(
            CustomActionSettings(
                allow_hosts=tuple(h for h in settings.custom_actions_allow_hosts.split(",") if h.strip()),
                shell_enabled=settings.custom_actions_shell,
                code_enabled=settings.custom_actions_code,
            )
        )
        log.info(
            "custom actions ready",
            config_actions=len(config),
            shell=settings.custom_actions_shell,
            code=settings.custom_actions_code,
        )
        return cls(CustomActionRegistry(CustomActionStore(db), directory, executor, config))

    def before_turns(
        self, handle: Callable[[Delivery], Awaitable[None]]
    ) -> Callable[[Delivery], Awaitable[None]]:
        """For the inbound consumer: the agent is the subject's last token."""
        return self.registry.before_turns(handle)

    def before_events(
        self, handle: Callable[[Delivery], Awaitable[None]]
    ) -> Callable[[Delivery], Awaitable[None]]:
        """For event consumers (a confirmed action runs on the replica that gets the event)."""
        return self.registry.before_turns(handle, agent_token=-2)
