"""The autonomy component of a runtime replica: keeps each agent's think section registered in the
model gateway's prompt batcher while its autonomy is on, and turns each result into one
autonomous turn.

Every replica listens to the results of the agents it serves. Each result is one tick (one drain
of the ``autonomy`` affinity, run by whichever scheduler claimed the BATCHER_DRAIN task), and
every replica that received it publishes the same autonomous message (its id names the section
and the drain) on the runtime's own subject: JetStream keeps one copy and the ingest statement
stores it once, so exactly one replica runs the tick's turn. A tick that finds the agent's last
autonomous turn still running is skipped, so an agent never has two at once.
"""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter

from parley.v1 import model_pb2, runtime_pb2
from parley_clients.batcher import BatcherClient
from parley_platform.bus import Bus
from parley_platform.convert import timestamp
from parley_platform.errors import ParleyError
from parley_platform.logging import get_logger

from ..agents.directory import AgentDirectory, AgentInfo
from ..turn.inbound import Origin
from ..turn.ports import Inbox
from . import policy
from .store import AutonomyStore

log = get_logger(__name__)


class AutonomyMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.ticks = Counter(
            "parley_autonomy_ticks_total",
            "Think results received by this replica, by what became of them",
            ["result"],
            registry=registry,
        )


@dataclass(frozen=True)
class Defaults:
    """The host's AUTONOMY_INTERVAL_MS and AUTONOMY_MODEL_SIZE (a character's settings win)."""

    interval_ms: object | None = None
    model_size: object | None = None


class Autonomy:
    def __init__(
        self,
        *,
        store: AutonomyStore,
        bus: Bus,
        directory: AgentDirectory,
        inbox: Inbox,
        registry: CollectorRegistry,
        defaults: Defaults = Defaults(),
        stale_seconds: float = 60.0,
        timeout: float = 10.0,
        resync_seconds: float = 30.0,
    ) -> None:
        self.store = store
        self.bus = bus
        self.directory = directory
        self.inbox = inbox
        self.defaults = defaults
        self.stale_seconds = stale_seconds
        self.timeout = timeout
        self._clients: dict[uuid.UUID, BatcherClient] = {}
        self._sections: dict[uuid.UUID, str] = {}  # the section each agent's results come from
        self._locks: dict[uuid.UUID, asyncio.Lock] = {}
        self._pending: set[asyncio.Task[None]] = set()
        self._resync: asyncio.Task[None] | None = None
        self.resync_seconds = resync_seconds
        self.ticks = AutonomyMetrics(registry).ticks

    # --- lifecycle -----------------------------------------------------------------------------

    async def start(self) -> None:
        for agent in list(self.directory.agents.values()):
            await self._sync_quietly(agent)
        self.directory.on_loaded(self._on_loaded)
        self._resync = asyncio.ensure_future(self._resync_loop())

    async def _on_loaded(self, agent: AgentInfo) -> None:
        """A reload must never wait for the gateway (a turn may be the reason for it)."""
        task = asyncio.ensure_future(self._sync_quietly(agent))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def _resync_loop(self) -> None:
        """Apply what a replica missed (the gateway was down, an announcement was lost)."""
        while True:
            await asyncio.sleep(self.resync_seconds)
            for agent in list(self.directory.agents.values()):
                await self._sync_quietly(agent)

    async def stop(self, timeout: float) -> None:
        """Stop listening; the sections stay registered for the other replicas."""
        if self._resync is not None:
            self._resync.cancel()
        for task in list(self._pending):
            task.cancel()
        for agent_id, client in list(self._clients.items()):
            section = self._sections.pop(agent_id, None)
            if section is not None:
                client.forget(section)
        self._clients.clear()

    # --- the switch ------------------------------------------------------------------------------

    async def plan(self, agent: AgentInfo) -> policy.Plan:
        switch = await self.store.switch(agent.id)
        if switch is not None:
            enabled, decided_by, generation = switch.enabled, "operator", switch.generation
        else:
            enabled = any(agent.flag(key) for key in policy.ENABLED_SETTINGS)
            decided_by, generation = "character", 0
        interval = agent.setting("AUTONOMY_INTERVAL_MS")
        size = agent.setting("AUTONOMY_MODEL_SIZE")
        return policy.Plan(
            enabled=enabled,
            decided_by=decided_by,
            generation=generation,
            interval_ms=policy.interval_ms(interval if interval is not None else self.defaults.interval_ms),
            model_size=policy.model_size(size if size is not None else self.defaults.model_size),
            prompt=policy.think_prompt(agent.character, agent.catalog.actions),
        )

    async def set(self, agent: AgentInfo, enabled: bool) -> runtime_pb2.AutonomyStatus:
        """The operator's switch: stored, applied here, then announced so every replica applies it."""
        await self.store.set_switch(agent.id, enabled)
        await self._sync_quietly(agent)  # stored: a gateway down now is caught up by the resync
        await self.directory.announce(str(agent.id))
        return await self.status(agent)

    async def status(self, agent: AgentInfo) -> runtime_pb2.AutonomyStatus:
        plan = await self.plan(agent)
        counts = await self.store.counts(agent.id)
        return runtime_pb2.AutonomyStatus(
            agent_id=str(agent.id),
            enabled=plan.enabled,
            decided_by=plan.decided_by,
            interval_ms=plan.interval_ms,
            model_size=plan.model_size,
            generation=plan.generation,
            turns=counts.turns,
            last_turn_at=timestamp(counts.last_at),
        )

    async def _sync_quietly(self, agent: AgentInfo) -> None:
        try:
            await self.sync(agent)
        except ParleyError as exc:
            # The gateway may not be up yet: the next reload of the agent (or switch) tries again.
            log.warning("autonomy not applied", agent_id=str(agent.id), error=exc.code)

    async def sync(self, agent: AgentInfo) -> None:
        """Make this replica's part match the agent's plan: its section registered (by whichever
        replica comes first) and listened to while on; disposed when off."""
        lock = self._locks.setdefault(agent.id, asyncio.Lock())
        async with lock:
            plan = await self.plan(agent)
            current = self._sections.get(agent.id)
            on = plan.enabled and agent.enabled
            if on and current == plan.section_id:
                return
            client = self._client(agent.id)
            if current is not None:
                client.forget(current)
                del self._sections[agent.id]
                await client.gateway.DisposeSections(
                    model_pb2.DisposeSectionsRequest(agent_id=str(agent.id), section_ids=[current])
                )
            if not on:
                # Off: whatever section of the agent any replica registered goes.
                await client.gateway.DisposeSections(
                    model_pb2.DisposeSectionsRequest(agent_id=str(agent.id), owner=policy.OWNER)
                )
                return

            async def on_result(result: model_pb2.SectionResult) -> None:
                await self.on_result(agent.id, result)

            registered = await client.think(
                plan.section_id,
                plan.prompt,
                policy.FIELDS,
                on_result=on_result,
                min_cycle_ms=plan.interval_ms,
                affinity=policy.AFFINITY,
                model_type=plan.model_type,
                system=agent.character.system,
            )
            if not registered:
                await client.listen(plan.section_id, on_result)
            self._sections[agent.id] = plan.section_id
            log.info(
                "autonomy on",
                agent_id=str(agent.id),
                section=plan.section_id,
                interval_ms=plan.interval_ms,
                model_size=plan.model_size,
                registered=registered,
            )

    def _client(self, agent_id: uuid.UUID) -> BatcherClient:
        client = self._clients.get(agent_id)
        if client is None:
            client = BatcherClient(self.bus, str(agent_id), owner=policy.OWNER, timeout=self.timeout)
            self._clients[agent_id] = client
        return client

    # --- ticks -------------------------------------------------------------------------------------

    async def on_result(self, agent_id: uuid.UUID, result: model_pb2.SectionResult) -> None:
        """One tick: the think answer becomes the autonomous message, unless autonomy went off, the
        model gave no answer, or the agent's last autonomous turn still runs."""
        if self._sections.get(agent_id) != result.section_id:
            self.ticks.labels("stale").inc()
            return
        agent = self.directory.agents.get(str(agent_id))
        if agent is None or not agent.enabled or not (await self.plan(agent)).enabled:
            self.ticks.labels("off").inc()
            return
        if result.fallback_used or not result.fields.get("thought", "").strip():
            log.info("autonomy tick without an answer", agent_id=str(agent_id), error=result.error[:200])
            self.ticks.labels("no_answer").inc()
            return
        if await self.store.busy(agent_id, self.stale_seconds):
            self.ticks.labels("busy").inc()
            return
        message = policy.message_of(agent_id, agent.character.name, result)
        await self.inbox.publish(message, Origin.AUTONOMOUS)
        self.ticks.labels("published").inc()
