"""Interaction leases: one holder per shared resource, fenced, renewed and released by that holder."""

from __future__ import annotations

from parley.v1 import authz_pb2
from parley_platform.errors import Conflict
from parley_platform.paging import cut, page_of
from parley_platform.retry import Backoff, retrying

from .. import domain, errors, validate
from ..model import Holder
from .edge import Handlers, strict

# Acquiring again at once: the holder that refused the grant let go of the resource since.
ACQUIRE_ATTEMPTS = 3
AT_ONCE = Backoff(base=0.0, cap=0.0)

HolderRequest = authz_pb2.AcquireLeaseRequest | authz_pb2.RenewLeaseRequest | authz_pb2.ReleaseLeaseRequest


class _HolderLetGo(Exception):
    """The grant was refused, and no live lease holds the resource any more."""


def _holder(request: HolderRequest) -> Holder:
    return Holder(
        agent_id=validate.agent_uuid(request.agent_id),
        lease_id=validate.opaque_id(request.lease_id, "lease_id"),
        session_id=validate.opaque_id(request.session_id, "session_id"),
        owner=validate.opaque_id(request.owner, "owner"),
        generation=validate.generation(request.generation),
    )


class Leases(Handlers):
    @strict
    async def AcquireLease(self, request: authz_pb2.AcquireLeaseRequest) -> authz_pb2.AcquireLeaseResponse:
        holder = _holder(request)
        kind = validate.resource_kind(request.resource.kind)
        resource_id = validate.opaque_id(request.resource.id, "resource.id")
        ttl_ms = validate.ttl_ms(request.ttl_ms, "ttl_ms", maximum=domain.MAX_LEASE_TTL_MS)
        held = f"{kind} {resource_id[:100]!r} is held by another lease"

        async def acquire() -> authz_pb2.AcquireLeaseResponse:
            lease = await self.store.acquire_lease(holder, kind, resource_id, ttl_ms)
            if lease is not None:
                self.metrics.decisions.labels("lease", "granted").inc()
                return authz_pb2.AcquireLeaseResponse(lease=lease.to_proto(), replayed=False)
            current = await self.store.lease_of_resource(holder.agent_id, kind, resource_id)
            if current is None or not current.live:
                raise _HolderLetGo
            if domain.same_holder(current, holder):
                self.metrics.decisions.labels("lease", "replayed").inc()
                return authz_pb2.AcquireLeaseResponse(lease=current.to_proto(), replayed=True)
            raise errors.LEASE_CONFLICT(held)

        try:
            return await retrying(
                acquire,
                attempts=ACQUIRE_ATTEMPTS,
                backoff=AT_ONCE,
                retry_if=lambda exc: isinstance(exc, _HolderLetGo),
            )
        except (Conflict, _HolderLetGo) as exc:
            self.metrics.lease_conflicts.inc()
            self.metrics.decisions.labels("lease", "lease_conflict").inc()
            if isinstance(exc, _HolderLetGo):  # it kept changing hands: another holder won it
                raise errors.LEASE_CONFLICT(held) from None
            raise

    @strict
    async def RenewLease(self, request: authz_pb2.RenewLeaseRequest) -> authz_pb2.RenewLeaseResponse:
        holder = _holder(request)
        ttl_ms = validate.ttl_ms(request.ttl_ms, "ttl_ms", maximum=domain.MAX_LEASE_TTL_MS)
        lease = await self.store.renew_lease(holder, ttl_ms)
        if lease is None:
            raise errors.STALE_LEASE("the lease is not held by this session, owner and generation")
        return authz_pb2.RenewLeaseResponse(lease=lease.to_proto())

    @strict
    async def ReleaseLease(self, request: authz_pb2.ReleaseLeaseRequest) -> authz_pb2.ReleaseLeaseResponse:
        release = await self.store.release_lease(_holder(request))
        if not release.released and release.held:
            self.metrics.lease_conflicts.inc()
            raise errors.LEASE_CONFLICT("the lease is held by another session, owner or generation")
        return authz_pb2.ReleaseLeaseResponse(released=release.released)

    @strict
    async def AssertLeases(self, request: authz_pb2.AssertLeasesRequest) -> authz_pb2.AssertLeasesResponse:
        agent_id = validate.agent_uuid(request.agent_id)
        if not request.HasField("required"):
            raise errors.LEASE_REQUIREMENTS_MISSING(
                "required is missing: list the resources the action needs, or pass an empty list"
            )
        lease_ids = [
            validate.opaque_id(value, f"lease_ids[{i}]") for i, value in enumerate(request.lease_ids)
        ]
        required = [
            (
                validate.resource_kind(r.kind, f"required.resources[{i}].kind"),
                validate.opaque_id(r.id, f"required.resources[{i}].id"),
            )
            for i, r in enumerate(request.required.resources)
        ]
        leases = await self.store.leases_by_id(agent_id, lease_ids) if lease_ids else []
        held = domain.check_leases(
            leases,
            lease_ids=lease_ids,
            session_id=validate.opaque_id(request.session_id, "session_id"),
            owner=validate.opaque_id(request.owner, "owner"),
            generation=validate.generation(request.generation),
            required=required,
        )
        return authz_pb2.AssertLeasesResponse(leases=[lease.to_proto() for lease in held])

    @strict
    async def ListLeases(self, request: authz_pb2.ListLeasesRequest) -> authz_pb2.ListLeasesResponse:
        agent_id = validate.agent_uuid(request.agent_id)
        page = page_of(request.page if request.HasField("page") else None)
        leases, page_response = cut(
            page, await self.store.list_leases(agent_id, request.include_expired, page.fetch, page.offset)
        )
        return authz_pb2.ListLeasesResponse(leases=[lease.to_proto() for lease in leases], page=page_response)
