"""A singleton plugin service: run on exactly one replica at a time, the one holding its authz
lease (resource kind ``plugin-service``, id ``<plugin>.<service>``).

Every replica keeps trying to acquire the lease; the one granted it starts the service with the
grant's fencing token and renews every third of the lease time. A replica that cannot renew
stops its service before the lease it last confirmed could have expired, so it never runs past
its lease; one that stops releases the lease so another takes over at once; one that dies
(SIGKILL) leaves the lease to expire, and the next replica to acquire it gets a higher fencing
token."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import Callable, Mapping

from parley.v1 import authz_pb2
from parley.v1.authz_nats import AuthzClient
from parley_platform.errors import ParleyError
from parley_platform.logging import get_logger

from ..sdk import Service, ServiceRun

log = get_logger(__name__)

LEASE_KIND = "plugin-service"
# Leases belong to an agent; plugin services belong to the runtime itself.
RUNTIME_AGENT = uuid.uuid5(uuid.NAMESPACE_URL, "parley:runtime:plugin-services")
LOST = frozenset({"LEASE_CONFLICT", "STALE_LEASE"})


class SingletonRunner:
    def __init__(
        self,
        plugin: str,
        service: Service,
        *,
        authz: AuthzClient,
        replica: str,
        settings: Mapping[str, object],
        ttl_ms: int,
        on_state: Callable[[str], None],
    ) -> None:
        self.plugin = plugin
        self.service = service
        self.authz = authz
        self.replica = replica
        self.settings = settings
        self.ttl = ttl_ms / 1000
        self.ttl_ms = ttl_ms
        self.on_state = on_state
        self.resource = authz_pb2.LeaseResource(kind=LEASE_KIND, id=f"{plugin}.{service.name}"[:200])
        self.lease_id = f"{replica}:{plugin}.{service.name}"[:200]
        self.fencing_token: int | None = None
        self._stopping = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.ensure_future(self._run())

    async def stop(self, timeout: float) -> None:
        self._stopping.set()
        if self._task is not None:
            try:
                await asyncio.wait_for(asyncio.shield(self._task), timeout)
            except TimeoutError:
                self._task.cancel()

    @property
    def agent_id(self) -> str:
        return str(RUNTIME_AGENT)

    async def _pause(self, seconds: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stopping.wait(), seconds)

    async def _run(self) -> None:
        self.on_state("standby")
        while not self._stopping.is_set():
            asked = time.monotonic()
            try:
                grant = await self.authz.AcquireLease(
                    authz_pb2.AcquireLeaseRequest(
                        resource=self.resource,
                        ttl_ms=self.ttl_ms,
                        agent_id=self.agent_id,
                        lease_id=self.lease_id,
                        session_id=self.replica,
                        owner=self.replica,
                        generation=1,
                    )
                )
            except ParleyError as exc:
                if exc.code not in LOST:
                    log.info("singleton lease not reachable", service=self.service.name, error=exc.code)
                # Standing by: ask again soon, so a lease left by a dead replica is taken over
                # within a tenth of the lease time of its expiry.
                await self._pause(self.ttl / 10)
                continue
            await self._hold(grant.lease.fencing_token, asked + self.ttl)
        self.on_state("stopped")

    async def _hold(self, token: int, valid_until: float) -> None:
        """Run the service while the lease is ours; stop it before the lease can lapse."""
        self.fencing_token = token
        name = self.service.name
        try:
            await self.service.start(ServiceRun(self.replica, self.settings, fencing_token=token))
        except Exception as exc:
            log.error("singleton service failed to start", service=name, error=f"{type(exc).__name__}: {exc}")
            self.on_state("failed")
            await self._release()
            await self._pause(self.ttl / 3)
            return
        self.on_state("running")
        log.info("singleton service running", service=name, fencing_token=token, replica=self.replica)
        margin = self.ttl / 6
        while not self._stopping.is_set():
            await self._pause(max(0.0, min(self.ttl / 3, valid_until - margin - time.monotonic())))
            if self._stopping.is_set():
                break
            asked = time.monotonic()
            try:
                await self.authz.RenewLease(
                    authz_pb2.RenewLeaseRequest(
                        ttl_ms=self.ttl_ms,
                        agent_id=self.agent_id,
                        lease_id=self.lease_id,
                        session_id=self.replica,
                        owner=self.replica,
                        generation=1,
                    )
                )
                valid_until = asked + self.ttl
            except ParleyError as exc:
                if exc.code in LOST or time.monotonic() >= valid_until - margin:
                    log.warning("singleton lease lost", service=name, fencing_token=token, error=exc.code)
                    break
        try:
            await asyncio.wait_for(self.service.stop(), max(margin, 1.0))
        except Exception as exc:
            log.warning("singleton service did not stop cleanly", service=name, error=repr(exc))
        self.fencing_token = None
        self.on_state("standby")
        if self._stopping.is_set():
            await self._release()

    async def _release(self) -> None:
        with contextlib.suppress(ParleyError):
            await self.authz.ReleaseLease(
                authz_pb2.ReleaseLeaseRequest(
                    agent_id=self.agent_id,
                    lease_id=self.lease_id,
                    session_id=self.replica,
                    owner=self.replica,
                    generation=1,
                )
            )
