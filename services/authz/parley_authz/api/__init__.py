"""The ``parley.v1.Authz`` service, served over gRPC and NATS: validate, one statement, answer.

Each area's handlers live in their own module; ``AuthzApi`` is all of them over one store.
"""

from __future__ import annotations

from parley_platform.bus import Bus

from ..events import Announcer
from ..metrics import AuthzMetrics
from ..model import ToolDecision
from ..store import AuthzStore
from .capabilities import Capabilities
from .interactions import Interactions
from .leases import Leases
from .tool_calls import ToolCalls

__all__ = ["AuthzApi"]


class AuthzApi(ToolCalls, Capabilities, Leases, Interactions):
    def __init__(
        self,
        *,
        store: AuthzStore,
        bus: Bus | None,
        metrics: AuthzMetrics,
        expiry_decision: ToolDecision = "deny",
    ) -> None:
        self.store = store
        self.bus = bus
        self.metrics = metrics
        self.expiry_decision = expiry_decision
        self.announcer = Announcer(bus, store) if bus is not None else None

    async def drain_announcements(self, timeout: float) -> None:
        if self.announcer is not None:
            await self.announcer.drain(timeout)

    async def aclose(self) -> None:
        if self.announcer is not None:
            await self.announcer.drain(5)
            await self.announcer.close()
