"""Plugins at run time on one replica: their ``init`` with each agent's validated settings, their
services (started in the agents' plugin order, dependencies first; stopped in reverse; singleton
ones through ``SingletonRunner``), and their handlers of the runtime's events.

A service object runs once per replica however many agents use its plugin; its settings are
the plugin's settings as the first agent to load it here resolves them. Its state is published
as ``parley_plugin_service_state{service, state}`` (1 for the current state): starting, running,
standby (a singleton another replica runs), failed, unhealthy (its ``health()`` said so), stopped.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Awaitable, Coroutine, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Gauge

from parley.v1.authz_nats import AuthzClient
from parley_platform.logging import get_logger

from ..sdk import EventView, Plugin, Service, ServiceRun
from .directory import AgentDirectory, AgentInfo
from .singletons import SingletonRunner

log = get_logger(__name__)

STATES = ("starting", "running", "standby", "failed", "unhealthy", "stopped")
HEALTH_INTERVAL_SECONDS = 10.0


class PluginServiceMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.state = Gauge(
            "parley_plugin_service_state",
            "Plugin services on this replica by state (1: the service is in this state)",
            ["service", "state"],
            registry=registry,
        )


class PluginServices:
    def __init__(
        self,
        directory: AgentDirectory,
        *,
        authz: AuthzClient,
        registry: CollectorRegistry,
        replica: str | None = None,
        lease_ttl_ms: int = 10_000,
    ) -> None:
        self.directory = directory
        self.authz = authz
        self.replica = replica or f"runtime-{uuid.uuid4().hex[:12]}"
        self.lease_ttl_ms = lease_ttl_ms
        self.running: dict[int, tuple[str, Service]] = {}  # by identity: one run per service object
        self.singletons: dict[int, SingletonRunner] = {}
        self.states: dict[str, str] = {}
        self._inited: dict[tuple[str, uuid.UUID], str] = {}  # (plugin, agent) → settings it got
        self._order: list[int] = []  # services in start order
        self._lock = asyncio.Lock()
        self._tasks: set[asyncio.Task[None]] = set()
        self._health: asyncio.Task[None] | None = None
        self.state_gauge = PluginServiceMetrics(registry).state

    def _set_state(self, service: str, state: str) -> None:
        self.states[service] = state
        for known in STATES:
            self.state_gauge.labels(service, known).set(1 if known == state else 0)

    async def start(self) -> None:
        for agent in list(self.directory.agents.values()):
            await self.on_agent(agent)
        self.directory.on_loaded(self.on_agent)
        self._health = asyncio.ensure_future(self._check_health())

    async def on_agent(self, agent: AgentInfo) -> None:
        """The agent's plugins, in order: init with its settings (once, and again when they
        change), then the services not running here yet."""
        async with self._lock:
            for plugin in agent.catalog.plugins:
                settings = agent.plugin_settings.get(plugin.name, {})
                await self._init(plugin, agent, settings)
                for service in plugin.services:
                    if id(service) not in self.running and id(service) not in self.singletons:
                        await self._start(plugin, service, settings)

    async def _init(self, plugin: Plugin, agent: AgentInfo, settings: Mapping[str, object]) -> None:
        if plugin.init is None:
            return
        digest = json.dumps(settings, sort_keys=True, default=str)
        if self._inited.get((plugin.name, agent.id)) == digest:
            return
        try:
            await plugin.init(settings)
        except Exception as exc:
            log.error(
                "plugin init failed",
                plugin=plugin.name,
                agent_id=str(agent.id),
                error=agent.redactor.redact(f"{type(exc).__name__}: {exc}"),
            )
            return
        self._inited[(plugin.name, agent.id)] = digest

    async def _start(self, plugin: Plugin, service: Service, settings: Mapping[str, object]) -> None:
        name = service.name
        if getattr(service, "singleton", False):
            runner = SingletonRunner(
                plugin.name,
                service,
                authz=self.authz,
                replica=self.replica,
                settings=settings,
                ttl_ms=self.lease_ttl_ms,
                on_state=lambda state: self._set_state(name, state),
            )
            self.singletons[id(service)] = runner
            self._order.append(id(service))
            runner.start()
            return
        self._set_state(name, "starting")
        try:
            await service.start(ServiceRun(self.replica, settings))
        except Exception as exc:
            # A service that cannot start leaves its plugin's actions usable; it is logged with
            # the plugin's name, not retried behind the operator's back.
            self._set_state(name, "failed")
            log.error(
                "plugin service failed to start",
                plugin=plugin.name,
                service=name,
                error=f"{type(exc).__name__}: {exc}",
            )
            return
        self.running[id(service)] = (plugin.name, service)
        self._order.append(id(service))
        self._set_state(name, "running")
        log.info("plugin service started", plugin=plugin.name, service=name)

    async def _check_health(self) -> None:
        while True:
            await asyncio.sleep(HEALTH_INTERVAL_SECONDS)
            running = [s for _, s in self.running.values()]
            running += [r.service for r in self.singletons.values() if r.fencing_token is not None]
            for service in running:
                check = getattr(service, "health", None)
                if check is None:
                    continue
                try:
                    healthy = bool(await check())
                except Exception:
                    healthy = False
                if self.states.get(service.name) in ("running", "unhealthy"):
                    self._set_state(service.name, "running" if healthy else "unhealthy")

    async def stop(self, timeout: float) -> None:
        if self._health is not None:
            self._health.cancel()
        async with self._lock:
            order, self._order = list(reversed(self._order)), []
            running, self.running = dict(self.running), {}
            singletons, self.singletons = dict(self.singletons), {}
        for key in order:
            if key in singletons:
                await singletons[key].stop(timeout)
                continue
            _, service = running[key]
            try:
                await asyncio.wait_for(service.stop(), timeout)
            except Exception as exc:
                log.warning("plugin service did not stop cleanly", service=service.name, error=repr(exc))
            self._set_state(service.name, "stopped")
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=timeout)

    # --- events -------------------------------------------------------------------------------------

    def dispatch(
        self,
        agent: AgentInfo,
        event_type: str,
        turn: uuid.UUID,
        room: uuid.UUID,
        attributes: Mapping[str, str],
    ) -> None:
        """Hand one of the runtime's events to the agent's plugins' handlers, in the background."""
        handlers = [h for p in agent.catalog.plugins for h in p.events.get(event_type, ())]
        if not handlers:
            return
        view = EventView(event_type, str(agent.id), str(room), str(turn), dict(attributes))
        for handler in handlers:
            self._spawn(self._handle(agent, handler(view), event_type))

    async def _handle(self, agent: AgentInfo, call: Awaitable[None], event_type: str) -> None:
        try:
            await call
        except Exception as exc:
            log.warning(
                "plugin event handler failed",
                event_type=event_type,
                agent_id=str(agent.id),
                error=agent.redactor.redact(f"{type(exc).__name__}: {exc}"),
            )

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
