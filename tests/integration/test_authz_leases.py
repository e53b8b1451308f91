"""Interaction leases (fencing tokens, the database's clock) and interaction confirmations against
real Postgres."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from parley.v1 import authz_pb2
from parley_authz.api import AuthzApi
from parley_authz.metrics import AuthzMetrics
from parley_authz.store import MIGRATIONS_DIR, SCHEMA, AuthzStore
from parley_platform import canonical
from parley_platform.errors import Conflict, FailedPrecondition, InvalidArgument, ParleyError
from parley_platform.postgres import Database, migrate
from parley_platform.testing import eventually
from support import SessionEnv


@pytest.fixture(scope="module")
async def db(test_env: SessionEnv) -> AsyncIterator[Database]:
    await migrate(test_env.database_url, SCHEMA, MIGRATIONS_DIR)
    database = Database(test_env.database_url, name="authz-test", min_size=1, max_size=4)
    await database.open()
    yield database
    await database.close()


@pytest.fixture
def registry() -> CollectorRegistry:
    return CollectorRegistry()


@pytest.fixture
def api(db: Database, registry: CollectorRegistry) -> AuthzApi:
    return AuthzApi(store=AuthzStore(db), bus=None, metrics=AuthzMetrics(registry))


@pytest.fixture
def agent() -> str:
    return str(uuid.uuid4())


async def refused(call: Any) -> ParleyError:
    with pytest.raises(ParleyError) as caught:
        await call
    return caught.value


def pointer() -> authz_pb2.LeaseResource:
    return authz_pb2.LeaseResource(kind="pointer", id="display-0")


async def acquire(
    api: AuthzApi,
    agent: str,
    lease_id: str,
    owner: str,
    *,
    resource: authz_pb2.LeaseResource | None = None,
    ttl_ms: int = 10_000,
    generation: int = 1,
) -> authz_pb2.AcquireLeaseResponse:
    return await api.AcquireLease(
        authz_pb2.AcquireLeaseRequest(
            agent_id=agent,
            resource=resource or pointer(),
            session_id=f"session-{owner}",
            owner=owner,
            generation=generation,
            lease_id=lease_id,
            ttl_ms=ttl_ms,
        )
    )


def assert_request(
    agent: str, owner: str, lease_ids: list[str], required: list[authz_pb2.LeaseResource] | None
) -> authz_pb2.AssertLeasesRequest:
    request = authz_pb2.AssertLeasesRequest(
        agent_id=agent, session_id=f"session-{owner}", owner=owner, generation=1, lease_ids=lease_ids
    )
    if required is not None:
        request.required.CopyFrom(authz_pb2.LeaseRequirements(resources=required))
    return request


async def test_holder_conflict_expiry_takeover_and_fencing(
    api: AuthzApi, agent: str, registry: CollectorRegistry
) -> None:
    a = await acquire(api, agent, "lease-a", "alice", ttl_ms=400)
    assert not a.replayed
    replay = await acquire(api, agent, "lease-a", "alice", ttl_ms=9_000)
    assert replay.replayed
    assert replay.lease == a.lease, "an exact replay returns the stored lease unchanged"

    conflict = await refused(acquire(api, agent, "lease-b", "bob"))
    assert conflict.code == "LEASE_CONFLICT"
    assert registry.get_sample_value("parley_authz_lease_conflicts_total") == 1
    held = await api.AssertLeases(assert_request(agent, "alice", ["lease-a"], [pointer()]))
    assert [lease.lease_id for lease in held.leases] == ["lease-a"]

    async def taken() -> authz_pb2.AcquireLeaseResponse | None:
        try:
            return await acquire(api, agent, "lease-b", "bob")
        except Conflict:
            return None

    b = await eventually(taken, timeout=5, interval=0.05, what="bob to take the expired pointer")
    assert b.lease.fencing_token > a.lease.fencing_token
    stale = await refused(api.AssertLeases(assert_request(agent, "alice", ["lease-a"], [pointer()])))
    assert isinstance(stale, FailedPrecondition)
    assert stale.code == "STALE_LEASE"
    renew = await refused(
        api.RenewLease(
            authz_pb2.RenewLeaseRequest(
                agent_id=agent,
                lease_id="lease-a",
                session_id="session-alice",
                owner="alice",
                generation=1,
                ttl_ms=1000,
            )
        )
    )
    assert renew.code == "STALE_LEASE"


async def test_renew_keeps_acquisition_and_token(api: AuthzApi, agent: str) -> None:
    first = (await acquire(api, agent, "lease-r", "alice", ttl_ms=1000)).lease
    renewed = (
        await api.RenewLease(
            authz_pb2.RenewLeaseRequest(
                agent_id=agent,
                lease_id="lease-r",
                session_id="session-alice",
                owner="alice",
                generation=1,
                ttl_ms=60_000,
            )
        )
    ).lease
    assert renewed.acquired_at == first.acquired_at
    assert renewed.fencing_token == first.fencing_token
    assert renewed.expires_at.ToMilliseconds() > first.expires_at.ToMilliseconds()
    other = await refused(
        api.RenewLease(
            authz_pb2.RenewLeaseRequest(
                agent_id=agent,
                lease_id="lease-r",
                session_id="session-alice",
                owner="mallory",
                generation=1,
                ttl_ms=1000,
            )
        )
    )
    assert other.code == "STALE_LEASE"
    newer_generation = await refused(acquire(api, agent, "lease-r2", "alice", generation=2))
    assert newer_generation.code == "LEASE_CONFLICT"


async def test_release_by_the_owner_only(api: AuthzApi, agent: str) -> None:
    await acquire(api, agent, "lease-x", "alice")

    def release(owner: str) -> authz_pb2.ReleaseLeaseRequest:
        return authz_pb2.ReleaseLeaseRequest(
            agent_id=agent, lease_id="lease-x", session_id=f"session-{owner}", owner=owner, generation=1
        )

    other = await refused(api.ReleaseLease(release("bob")))
    assert other.code == "LEASE_CONFLICT"
    assert (await api.ReleaseLease(release("alice"))).released
    assert not (await api.ReleaseLease(release("alice"))).released
    taken = await acquire(api, agent, "lease-y", "bob")
    assert not taken.replayed


async def test_a_lease_id_names_one_resource(api: AuthzApi, agent: str) -> None:
    await acquire(api, agent, "lease-k", "alice", resource=authz_pb2.LeaseResource(kind="keyboard", id="kb"))
    conflict = await refused(acquire(api, agent, "lease-k", "alice"))
    assert conflict.code == "LEASE_CONFLICT"
    assert "bound to another resource" in conflict.message


async def test_assert_leases_needs_an_explicit_list(api: AuthzApi, agent: str) -> None:
    missing = await refused(api.AssertLeases(assert_request(agent, "alice", [], None)))
    assert isinstance(missing, InvalidArgument)
    assert missing.code == "LEASE_REQUIREMENTS_MISSING"
    assert list((await api.AssertLeases(assert_request(agent, "alice", [], []))).leases) == []
    uncovered = await refused(api.AssertLeases(assert_request(agent, "alice", [], [pointer()])))
    assert uncovered.code == "STALE_LEASE"
    assert "required.resources[0]" in uncovered.message


@pytest.mark.parametrize(("ttl", "valid"), [(0, False), (1, True), (60_000, True), (60_001, False)])
async def test_ttl_is_at_most_a_minute(api: AuthzApi, agent: str, ttl: int, valid: bool) -> None:
    if valid:
        assert (await acquire(api, agent, f"lease-t{ttl}", "alice", ttl_ms=ttl)).lease.lease_id
        return
    bad = await refused(acquire(api, agent, "lease-t", "alice", ttl_ms=ttl))
    assert isinstance(bad, InvalidArgument)
    assert "ttl_ms must be from 1 to 60000" in bad.message


async def test_list_leases(api: AuthzApi, agent: str) -> None:
    await acquire(api, agent, "l-live", "alice", resource=authz_pb2.LeaseResource(kind="clipboard", id="c"))
    await acquire(api, agent, "l-short", "alice", ttl_ms=1)

    async def only_live() -> bool:
        live = await api.ListLeases(authz_pb2.ListLeasesRequest(agent_id=agent))
        return [lease.lease_id for lease in live.leases] == ["l-live"]

    await eventually(only_live, what="the 1 ms lease to expire")
    everything = await api.ListLeases(authz_pb2.ListLeasesRequest(agent_id=agent, include_expired=True))
    assert {lease.lease_id for lease in everything.leases} == {"l-live", "l-short"}


# ----- interaction confirmations --------------------------------------------------------------

ACTION = {"kind": "type_text", "session_id": "s1", "target": {"element": 17}, "text": "hello"}


def action_json(**extra: Any) -> str:
    return json.dumps({**ACTION, **extra})


async def register(api: AuthzApi, agent: str, confirmation_id: str, action: str, ttl_ms: int = 0) -> Any:
    return await api.RegisterInteractionConfirmation(
        authz_pb2.RegisterInteractionConfirmationRequest(
            agent_id=agent, confirmation_id=confirmation_id, action_json=action, ttl_ms=ttl_ms
        )
    )


async def issue(api: AuthzApi, agent: str, confirmation_id: str, digest: str) -> Any:
    return await api.IssueInteractionConfirmation(
        authz_pb2.IssueInteractionConfirmationRequest(
            agent_id=agent, confirmation_id=confirmation_id, action_digest=digest
        )
    )


async def consume(api: AuthzApi, agent: str, confirmation_id: str, grant_id: str, action: str) -> Any:
    return await api.ConsumeInteractionConfirmation(
        authz_pb2.ConsumeInteractionConfirmationRequest(
            agent_id=agent, confirmation_id=confirmation_id, grant_id=grant_id, action_json=action
        )
    )


async def test_interaction_confirmation_register_issue_consume_once(api: AuthzApi, agent: str) -> None:
    registered = await register(api, agent, "ic-1", action_json())
    digest = canonical.interaction_action_digest(ACTION)
    assert registered.created
    assert registered.confirmation.action_digest == digest
    assert registered.confirmation.state == authz_pb2.INTERACTION_CONFIRMATION_STATE_PENDING
    assert not (await register(api, agent, "ic-1", action_json())).created
    reused = await refused(register(api, agent, "ic-1", action_json(text="bye")))
    assert reused.code == "INTERACTION_CONFIRMATION_REUSED"

    early = await refused(consume(api, agent, "ic-1", "whatever", action_json()))
    assert early.code == "STALE_INTERACTION_CONFIRMATION"
    mismatch = await refused(
        issue(api, agent, "ic-1", canonical.interaction_action_digest({"kind": "click"}))
    )
    assert mismatch.code == "INTERACTION_CONFIRMATION_MISMATCH"
    issued = (await issue(api, agent, "ic-1", digest)).confirmation
    assert issued.state == authz_pb2.INTERACTION_CONFIRMATION_STATE_ISSUED
    grant = issued.grant_id
    again = await refused(issue(api, agent, "ic-1", digest))
    assert again.code == "STALE_INTERACTION_CONFIRMATION"

    swapped = await refused(consume(api, agent, "ic-1", grant, action_json(text="rm -rf /")))
    assert swapped.code == "INTERACTION_CONFIRMATION_MISMATCH"
    wrong_grant = await refused(consume(api, agent, "ic-1", "not-the-grant", action_json()))
    assert wrong_grant.code == "INTERACTION_CONFIRMATION_MISMATCH"
    # The grant and lease ids the dispatcher adds are not part of what was confirmed.
    used = await consume(api, agent, "ic-1", grant, action_json(grant_id=grant, lease_ids=["l1"]))
    assert used.confirmation.state == authz_pb2.INTERACTION_CONFIRMATION_STATE_CONSUMED
    replay = await refused(consume(api, agent, "ic-1", grant, action_json()))
    assert replay.code == "STALE_INTERACTION_CONFIRMATION"
    assert "already been used" in replay.message


async def test_interaction_confirmation_expires(api: AuthzApi, agent: str) -> None:
    await register(api, agent, "ic-2", action_json(), ttl_ms=200)
    grant = (
        await issue(api, agent, "ic-2", canonical.interaction_action_digest(ACTION))
    ).confirmation.grant_id

    async def expired() -> ParleyError | None:
        try:
            await consume(api, agent, "ic-2", grant, action_json(text="probe-" + uuid.uuid4().hex))
        except FailedPrecondition as exc:
            return exc if exc.code == "STALE_INTERACTION_CONFIRMATION" else None
        return None

    stale = await eventually(expired, timeout=5, what="the confirmation to expire")
    assert "expired" in stale.message
    still = await refused(consume(api, agent, "ic-2", grant, action_json()))
    assert still.code == "STALE_INTERACTION_CONFIRMATION"


async def test_interaction_action_contract(api: AuthzApi, agent: str) -> None:
    for text, mentions in [
        ('{"kind": "click", "x": 1.5}', "fraction"),
        ('{"kind": "click", "kind": "type"}', "duplicate key"),
        ('["click"]', "must be a JSON object"),
        ('{"password": "hunter2"', "not valid JSON"),
    ]:
        bad = await refused(register(api, agent, "ic-bad", text))
        assert bad.code == "INVALID_CONTRACT"
        assert mentions in bad.message
        assert "hunter2" not in str(bad)
