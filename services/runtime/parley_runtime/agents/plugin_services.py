"""Plugin services: what a plugin runs beside its agents' turns (a poller, a cache, a client),
started on every replica for the plugins its agents use, and stopped when the replica stops."""

from __future__ import annotations

import asyncio

from parley_platform.logging import get_logger

from ..sdk import Service
from .directory import AgentDirectory, AgentInfo

log = get_logger(__name__)


class PluginServices:
    def __init__(self, directory: AgentDirectory) -> None:
        self.directory = directory
        self.running: dict[int, Service] = {}  # by identity: one run per service object
        self._lock = asyncio.Lock()

    async def start(self) -> None:
        for agent in list(self.directory.agents.values()):
            await self.on_agent(agent)
        self.directory.on_loaded(self.on_agent)

    async def on_agent(self, agent: AgentInfo) -> None:
        """Start the services of the agent's plugins that are not running yet."""
        async with self._lock:
            for plugin in agent.catalog.plugins:
                for service in plugin.services:
                    if id(service) in self.running:
                        continue
                    try:
                        await service.start()
                    except Exception as exc:
                        # A service that cannot start leaves its plugin's actions usable; it is
                        # logged with the plugin's name, not retried behind the operator's back.
                        log.error(
                            "plugin service failed to start",
                            plugin=plugin.name,
                            service=service.name,
                            error=f"{type(exc).__name__}: {exc}",
                        )
                        continue
                    self.running[id(service)] = service
                    log.info("plugin service started", plugin=plugin.name, service=service.name)

    async def stop(self, timeout: float) -> None:
        async with self._lock:
            services, self.running = list(self.running.values()), {}
        for service in reversed(services):
            try:
                await asyncio.wait_for(service.stop(), timeout)
            except Exception as exc:
                log.warning("plugin service did not stop cleanly", service=service.name, error=repr(exc))
