"""Capability authorization against real Postgres: binding, registration (ids usable once, ever),
confirmation grants, Authorize as one compare-and-delete that burns stale authority, receipts bound
to the exact authorization, and the typed errors."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import time
import uuid
from collections.abc import AsyncIterator
from datetime import UTC
from typing import Any

import pytest
from google.protobuf.timestamp_pb2 import Timestamp
from prometheus_client import CollectorRegistry

from parley.v1 import authz_pb2
from parley_authz.api import AuthzApi
from parley_authz.metrics import AuthzMetrics
from parley_authz.store import MIGRATIONS_DIR, SCHEMA, AuthzStore
from parley_platform import canonical
from parley_platform.canonical import InvalidContract
from parley_platform.errors import (
    Conflict,
    FailedPrecondition,
    NotFound,
    ParleyError,
    PermissionDenied,
    Unavailable,
)
from parley_platform.postgres import Database, migrate
from parley_platform.testing import eventually
from support import SessionEnv, migrated

SECRET_ARGS = {"to": "bob@example.com", "api_key": "sk-live-never-in-authz"}


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


def burned(registry: CollectorRegistry, reason: str) -> float | None:
    return registry.get_sample_value("parley_authz_burned_total", {"reason": reason})


@pytest.fixture
async def agent(api: AuthzApi) -> str:
    agent_id = str(uuid.uuid4())
    await connect(api, agent_id, "acct-1", "v1")
    return agent_id


def ms_ts(millis: int) -> Timestamp:
    return Timestamp(seconds=millis // 1000, nanos=(millis % 1000) * 1_000_000)


def now_ms() -> int:
    return int(time.time() * 1000)


async def connect(api: AuthzApi, agent: str, account: str, version: str) -> bool:
    reply = await api.PutAccountSnapshot(
        authz_pb2.PutAccountSnapshotRequest(agent_id=agent, account_id=account, snapshot_version=version)
    )
    return reply.created


def capability_request(agent: str, *, snapshot: str = "v1", args: Any = None) -> authz_pb2.CapabilityRequest:
    return authz_pb2.CapabilityRequest(
        version=1,
        agent_id=agent,
        account_id="acct-1",
        snapshot_version=snapshot,
        capability="mail.send",
        operation="create",
        catalog_risk=authz_pb2.RISK_LEVEL_R2,
        risk=authz_pb2.RISK_LEVEL_R3,
        input_digest=canonical.tool_arguments_digest(args if args is not None else SECRET_ARGS),
        bound_at=ms_ts(now_ms() - 50),
    )


def policy(
    request: authz_pb2.CapabilityRequest,
    decision_id: str | None = None,
    *,
    outcome: int = authz_pb2.POLICY_OUTCOME_ALLOWED,
    confirmation_id: str = "",
    ttl_ms: int = 60_000,
    **extra: Any,
) -> authz_pb2.PolicyDecision:
    issued = now_ms()
    decision = authz_pb2.PolicyDecision(
        version=1,
        decision_id=decision_id or f"d-{uuid.uuid4().hex[:12]}",
        request_digest=canonical.request_digest(request),
        outcome=outcome,  # type: ignore[arg-type]
        confirmation_id=confirmation_id,
        issued_at=ms_ts(issued),
        expires_at=ms_ts(issued + ttl_ms),
        **extra,
    )
    decision.digest = canonical.decision_digest(decision)
    return decision


async def register(
    api: AuthzApi, request: authz_pb2.CapabilityRequest, decision: authz_pb2.PolicyDecision
) -> authz_pb2.RegisterDecisionResponse:
    return await api.RegisterDecision(authz_pb2.RegisterDecisionRequest(request=request, decision=decision))


async def authorize(
    api: AuthzApi,
    request: authz_pb2.CapabilityRequest,
    decision: authz_pb2.PolicyDecision,
    grant: authz_pb2.ConfirmationGrant | None = None,
) -> authz_pb2.CapabilityAuthorization:
    reply = await api.Authorize(
        authz_pb2.AuthorizeRequest(
            request=request, decision_id=decision.decision_id, decision_digest=decision.digest, grant=grant
        )
    )
    return reply.authorization


async def issue(
    api: AuthzApi, agent: str, decision: authz_pb2.PolicyDecision, confirmation_id: str | None = None
) -> authz_pb2.ConfirmationGrant:
    reply = await api.IssueConfirmation(
        authz_pb2.IssueConfirmationRequest(
            agent_id=agent,
            confirmation_id=confirmation_id or decision.confirmation_id,
            decision_id=decision.decision_id,
            decision_digest=decision.digest,
            issued_by="user:alice",
        )
    )
    return reply.grant


async def refused(call: Any) -> ParleyError:
    with pytest.raises(ParleyError) as caught:
        await call
    return caught.value


async def test_bind_raises_risk_and_returns_the_canonical_digest(api: AuthzApi, agent: str) -> None:
    reply = await api.BindCapabilityRequest(
        authz_pb2.BindCapabilityRequestRequest(
            agent_id=agent,
            account_id="acct-1",
            snapshot_version="v1",
            capability="mail.send",
            operation="create",
            catalog_risk=authz_pb2.RISK_LEVEL_R2,
            contextual_risk=authz_pb2.RISK_LEVEL_R0,
            input_digest="e" * 64,
        )
    )
    assert reply.request.risk == authz_pb2.RISK_LEVEL_R2, "contextual risk never lowers the catalog's"
    assert reply.request_digest == canonical.request_digest(reply.request)
    assert (
        hashlib.sha256(b"parley:capability-request:v1\n" + reply.canonical_json.encode()).hexdigest()
        == reply.request_digest
    )
    assert abs(reply.request.bound_at.ToMilliseconds() - now_ms()) < 5000
    raised = await api.BindCapabilityRequest(
        authz_pb2.BindCapabilityRequestRequest(
            agent_id=agent,
            account_id="acct-1",
            snapshot_version="v1",
            capability="mail.send",
            operation="create",
            catalog_risk=authz_pb2.RISK_LEVEL_R1,
            contextual_risk=authz_pb2.RISK_LEVEL_R3,
            input_digest="e" * 64,
        )
    )
    assert raised.request.risk == authz_pb2.RISK_LEVEL_R3
    # A bound request registers and authorizes like any other.
    decision = policy(raised.request)
    await register(api, raised.request, decision)
    assert (await authorize(api, raised.request, decision)).request_digest == raised.request_digest


async def test_allowed_decision_authorizes_once(api: AuthzApi, agent: str) -> None:
    request = capability_request(agent)
    decision = policy(request)
    registered = await register(api, request, decision)
    assert registered.created
    assert registered.decision_digest == decision.digest
    assert registered.request_digest == canonical.request_digest(request)

    authorization = await authorize(api, request, decision)
    assert authorization.id == canonical.authorization_id(
        agent, canonical.request_digest(request), decision.digest, None
    )
    assert authorization.capability == "mail.send"
    assert authorization.risk == authz_pb2.RISK_LEVEL_R3
    assert authorization.grant_digest == ""
    assert authorization.authorized_at.nanos % 1_000_000 == 0

    again = await refused(authorize(api, request, decision))
    assert again.code == "STALE_CAPABILITY_AUTHORIZATION"
    assert "consumed" in again.message


async def test_registration_is_idempotent_but_ids_are_usable_once_ever(api: AuthzApi, agent: str) -> None:
    request = capability_request(agent)
    decision = policy(request, "d-once")
    assert (await register(api, request, decision)).created
    assert not (await register(api, request, decision)).created, "a lost reply retried"
    other = policy(request, "d-once", ttl_ms=30_000)
    reused = await refused(register(api, request, other))
    assert isinstance(reused, Conflict)
    assert reused.code == "CAPABILITY_DECISION_REUSED"
    await authorize(api, request, decision)
    after = await refused(register(api, request, decision))
    assert after.code == "CAPABILITY_DECISION_REUSED"


async def test_concurrent_registrations_of_one_id_register_it_once(api: AuthzApi, agent: str) -> None:
    request = capability_request(agent)
    decisions = [policy(request, "d-race", ttl_ms=60_000 + i) for i in range(8)]
    results = await asyncio.gather(*(register(api, request, d) for d in decisions), return_exceptions=True)
    created = [r for r in results if isinstance(r, authz_pb2.RegisterDecisionResponse) and r.created]
    assert len(created) == 1
    assert all(isinstance(r, Conflict) for r in results if r not in created)


async def test_refused_outcomes_are_not_registered(api: AuthzApi, agent: str) -> None:
    request = capability_request(agent)
    denied = await refused(
        register(
            api,
            request,
            policy(
                request,
                outcome=authz_pb2.POLICY_OUTCOME_DENIED,
                denial_code=authz_pb2.POLICY_DENIAL_CODE_USER_POLICY_DENIED,
            ),
        )
    )
    assert isinstance(denied, PermissionDenied)
    assert denied.code == "CAPABILITY_POLICY_DENIED"
    assert "user_policy_denied" in denied.message
    unavailable = await refused(
        register(
            api,
            request,
            policy(
                request,
                outcome=authz_pb2.POLICY_OUTCOME_UNAVAILABLE,
                unavailable_code="policy_engine_unreachable",
                retryable=True,
            ),
        )
    )
    assert isinstance(unavailable, Unavailable)
    assert unavailable.code == "CAPABILITY_UNAVAILABLE"
    assert unavailable.retryable


async def test_confirmation_is_required_issued_for_its_decision_and_used_once(
    api: AuthzApi, agent: str
) -> None:
    request = capability_request(agent)
    decision = policy(
        request,
        outcome=authz_pb2.POLICY_OUTCOME_CONFIRMATION_REQUIRED,
        confirmation_id="c-" + uuid.uuid4().hex,
    )
    registered = await register(api, request, decision)
    assert registered.confirmation_id == decision.confirmation_id

    required = await refused(authorize(api, request, decision))
    assert required.code == "CAPABILITY_CONFIRMATION_REQUIRED"

    other_request = capability_request(agent, args={"to": "eve"})
    other = policy(
        other_request, outcome=authz_pb2.POLICY_OUTCOME_CONFIRMATION_REQUIRED, confirmation_id="c-o"
    )
    await register(api, other_request, other)
    wrong = await refused(issue(api, agent, other, confirmation_id=decision.confirmation_id))
    assert wrong.code == "STALE_CAPABILITY_CONFIRMATION"

    grant = await issue(api, agent, decision)
    assert grant.digest == canonical.grant_digest(grant)
    assert grant.decision_digest == decision.digest
    twice = await refused(issue(api, agent, decision))
    assert twice.code == "STALE_CAPABILITY_CONFIRMATION"

    forged = authz_pb2.ConfirmationGrant()
    forged.CopyFrom(grant)
    forged.grant_id = "forged"
    forged.digest = canonical.grant_digest(forged)
    stale = await refused(authorize(api, request, decision, forged))
    assert stale.code == "STALE_CAPABILITY_CONFIRMATION"
    tampered = authz_pb2.ConfirmationGrant()
    tampered.CopyFrom(grant)
    tampered.grant_id = "forged"
    bad = await refused(authorize(api, request, decision, tampered))
    assert isinstance(bad, InvalidContract)
    assert "grant.digest is not the digest of the grant" in bad.message

    authorization = await authorize(api, request, decision, grant)
    assert authorization.grant_digest == grant.digest
    assert authorization.id == canonical.authorization_id(
        agent, canonical.request_digest(request), decision.digest, grant.digest
    )
    replay = await refused(authorize(api, request, decision, grant))
    assert replay.code == "STALE_CAPABILITY_AUTHORIZATION"


async def test_revoked_snapshot_burns_the_authority_and_reconnecting_does_not_revive_it(
    api: AuthzApi, agent: str, registry: CollectorRegistry
) -> None:
    request = capability_request(agent)
    decision = policy(request, outcome=authz_pb2.POLICY_OUTCOME_CONFIRMATION_REQUIRED, confirmation_id="c-r")
    await register(api, request, decision)
    grant = await issue(api, agent, decision)
    revoked = await api.RevokeAccountSnapshot(
        authz_pb2.RevokeAccountSnapshotRequest(agent_id=agent, account_id="acct-1")
    )
    assert revoked.revoked

    stale = await refused(authorize(api, request, decision, grant))
    assert stale.code == "STALE_CAPABILITY_AUTHORIZATION"
    assert "burned" in stale.message
    assert burned(registry, "snapshot") == 1

    # Reconnecting gets a new snapshot; the old one never becomes current again.
    assert await connect(api, agent, "acct-1", "v2")
    retired = await refused(connect(api, agent, "acct-1", "v1"))
    assert retired.code == "SNAPSHOT_VERSION_RETIRED"
    still = await refused(authorize(api, request, decision, grant))
    assert still.code == "STALE_CAPABILITY_AUTHORIZATION"
    # Re-registering the burned id for the new snapshot is refused too.
    renewed = capability_request(agent, snapshot="v2")
    again = await refused(register(api, renewed, policy(renewed, decision.decision_id)))
    assert again.code == "CAPABILITY_DECISION_REUSED"


async def test_a_replaced_snapshot_is_stale_and_registration_needs_a_current_one(
    api: AuthzApi, agent: str
) -> None:
    request = capability_request(agent)
    decision = policy(request)
    await register(api, request, decision)
    assert not await connect(api, agent, "acct-1", "v1"), "the current snapshot again is a no-op"
    assert await connect(api, agent, "acct-1", "v9")
    stale = await refused(authorize(api, request, decision))
    assert stale.code == "STALE_CAPABILITY_AUTHORIZATION"
    late = await refused(register(api, request, policy(request)))
    assert late.code == "STALE_CAPABILITY_AUTHORIZATION"


async def test_expired_decision_is_burned(
    api: AuthzApi, agent: str, registry: CollectorRegistry, db: Database
) -> None:
    request = capability_request(agent)
    decision = policy(request, ttl_ms=300)
    await register(api, request, decision)
    expires = decision.expires_at.ToDatetime(tzinfo=UTC)

    async def passed() -> bool:
        row = await db.fetchone("SELECT now() AS now")
        return bool(row and row["now"] > expires)

    await eventually(passed, timeout=5, what="the decision to expire")
    stale = await refused(authorize(api, request, decision))
    assert stale.code == "STALE_CAPABILITY_AUTHORIZATION"
    assert "expired" in stale.message
    assert burned(registry, "expired") == 1


async def test_untrusted_decisions(api: AuthzApi, agent: str) -> None:
    request = capability_request(agent)
    unknown = await refused(authorize(api, request, policy(request, "never-registered")))
    assert unknown.code == "UNTRUSTED_CAPABILITY_POLICY_DECISION"

    decision = policy(request)
    await register(api, request, decision)
    swapped = capability_request(agent, args={"to": "mallory"})
    mismatch = await refused(authorize(api, swapped, decision))
    assert mismatch.code == "UNTRUSTED_CAPABILITY_POLICY_DECISION"
    wrong_digest = await refused(
        api.Authorize(
            authz_pb2.AuthorizeRequest(
                request=request, decision_id=decision.decision_id, decision_digest="f" * 64
            )
        )
    )
    assert wrong_digest.code == "UNTRUSTED_CAPABILITY_POLICY_DECISION"
    other_agent = str(uuid.uuid4())
    elsewhere = await refused(authorize(api, capability_request(other_agent), decision))
    assert elsewhere.code == "UNTRUSTED_CAPABILITY_POLICY_DECISION"
    # None of those spent it.
    assert (await authorize(api, request, decision)).decision_id == decision.decision_id


async def test_receipts_cite_the_exact_authorization(api: AuthzApi, agent: str) -> None:
    request = capability_request(agent)
    decision = policy(request)
    await register(api, request, decision)
    authorization = await authorize(api, request, decision)
    authorized_ms = authorization.authorized_at.ToMilliseconds()

    def receipt(**overrides: Any) -> authz_pb2.EffectReceipt:
        fields: dict[str, Any] = {
            "version": 1,
            "authorization_id": authorization.id,
            "request_digest": authorization.request_digest,
            "decision_digest": authorization.decision_digest,
            "account_id": authorization.account_id,
            "capability": authorization.capability,
            "operation": authorization.operation,
            "input_digest": authorization.input_digest,
            "idempotency_key": authorization.request_digest,
            "status": authz_pb2.EFFECT_STATUS_COMMITTED,
            "committed_at": ms_ts(authorized_ms),
            "observed_at": ms_ts(authorized_ms + 1),
        }
        fields.update(overrides)
        return authz_pb2.EffectReceipt(**fields)

    async def record(r: authz_pb2.EffectReceipt) -> authz_pb2.RecordReceiptResponse:
        return await api.RecordReceipt(authz_pb2.RecordReceiptRequest(agent_id=agent, receipt=r))

    for overrides, mentions in [
        ({"capability": "mail.delete"}, "receipt.capability does not match the authorization"),
        ({"input_digest": "9" * 64}, "receipt.input_digest does not match"),
        ({"grant_digest": "8" * 64}, "receipt.grant_digest does not match"),
        ({"idempotency_key": "7" * 64}, "receipt.idempotency_key must equal"),
        ({"committed_at": ms_ts(authorized_ms - 1)}, "receipt.committed_at precedes the authorization"),
        (
            {"committed_at": ms_ts(now_ms() + 60_000), "observed_at": ms_ts(now_ms() + 60_000)},
            "receipt.observed_at is in the future",
        ),
    ]:
        bad = await refused(record(receipt(**overrides)))
        assert isinstance(bad, InvalidContract), overrides
        assert mentions in bad.message

    first = await record(receipt())
    assert first.created
    assert first.receipt_digest == canonical.receipt_digest(receipt())
    replay = await record(receipt())
    assert not replay.created
    assert replay.recorded_at == first.recorded_at
    conflicting = await refused(
        record(
            receipt(
                status=authz_pb2.EFFECT_STATUS_FAILED,
                error_code=authz_pb2.EXECUTION_ERROR_CODE_TIMEOUT,
                committed_at=None,
            )
        )
    )
    assert conflicting.code == "RECEIPT_CONFLICT"
    missing = await refused(record(receipt(authorization_id="6" * 64)))
    assert isinstance(missing, NotFound)
    assert missing.code == "AUTHORIZATION_NOT_FOUND"


async def test_contract_errors_name_the_field_and_never_echo_values(api: AuthzApi, agent: str) -> None:
    request = capability_request(agent)
    request.account_id = "sk-live-secret\x00"
    bad = await refused(register(api, request, policy(capability_request(agent))))
    assert bad.code == "INVALID_CONTRACT"
    assert "request.account_id" in bad.message
    assert "sk-live" not in str(bad)

    good = capability_request(agent)
    decision = policy(good)
    extended = authz_pb2.PolicyDecision.FromString(decision.SerializeToString() + bytes([0xC8, 0x01, 0x07]))
    unknown = await refused(
        api.RegisterDecision(authz_pb2.RegisterDecisionRequest(request=good, decision=extended))
    )
    assert unknown.code == "INVALID_CONTRACT"
    assert "request.decision has a field this service does not know (field number 25)" in unknown.message

    versioned = capability_request(agent)
    versioned.version = 2
    old = await refused(authorize(api, versioned, decision))
    assert old.code == "INVALID_CONTRACT"
    assert "request.version must be 1" in old.message
    missing = await refused(api.RegisterDecision(authz_pb2.RegisterDecisionRequest(request=good)))
    assert "decision is required" in missing.message
    assert isinstance(missing, InvalidContract)


async def test_issue_confirmation_after_revocation_is_stale(api: AuthzApi, agent: str) -> None:
    request = capability_request(agent)
    decision = policy(request, outcome=authz_pb2.POLICY_OUTCOME_CONFIRMATION_REQUIRED, confirmation_id="c-x")
    await register(api, request, decision)
    await api.RevokeAccountSnapshot(
        authz_pb2.RevokeAccountSnapshotRequest(agent_id=agent, account_id="acct-1")
    )
    stale = await refused(issue(api, agent, decision))
    assert isinstance(stale, FailedPrecondition)
    assert stale.code == "STALE_CAPABILITY_AUTHORIZATION"
    unknown = await refused(issue(api, agent, decision, confirmation_id="c-never"))
    assert unknown.code == "STALE_CAPABILITY_CONFIRMATION"


async def expired_decisions(
    api: AuthzApi, db: Database, agent: str, n: int
) -> list[tuple[authz_pb2.CapabilityRequest, authz_pb2.PolicyDecision]]:
    """``n`` registered decisions, every other one waiting for a confirmation, all expired by the
    database's clock."""
    registered = []
    for i in range(n):
        request = capability_request(agent)
        if i % 2:
            decision = policy(
                request,
                outcome=authz_pb2.POLICY_OUTCOME_CONFIRMATION_REQUIRED,
                confirmation_id=f"c-{uuid.uuid4().hex[:12]}",
                ttl_ms=300,
            )
        else:
            decision = policy(request, ttl_ms=300)
        await register(api, request, decision)
        registered.append((request, decision))
    latest = max(d.expires_at.ToDatetime(tzinfo=UTC) for _, d in registered)

    async def passed() -> bool:
        row = await db.fetchone("SELECT now() AS now")
        return bool(row and row["now"] > latest)

    await eventually(passed, timeout=10, what="the decisions to expire")
    return registered


async def decisions_left(db: Database, agent: str) -> int:
    row = await db.fetchone(
        "SELECT count(*) AS n FROM authz.capability_decision WHERE agent_id = %s", (uuid.UUID(agent),)
    )
    assert row is not None
    return int(row["n"])


async def confirmation_states(db: Database, agent: str) -> list[str]:
    rows = await db.fetchall(
        "SELECT state FROM authz.capability_confirmation WHERE agent_id = %s", (uuid.UUID(agent),)
    )
    return sorted(row["state"] for row in rows)


async def test_expired_decisions_nobody_authorized_are_swept_after_their_retention(
    api: AuthzApi, agent: str, db: Database
) -> None:
    store = api.store
    live_request = capability_request(agent)
    live = policy(live_request)
    await register(api, live_request, live)
    expired = await expired_decisions(api, db, agent, 4)

    # Within the retention nothing is swept: an Authorize is still told the decision expired.
    await store.sweep_expired_decisions(3600, 1000)
    assert await decisions_left(db, agent) == 5
    assert await confirmation_states(db, agent) == ["pending", "pending"]

    swept = 0
    while (batch := await store.sweep_expired_decisions(0, 3)) > 0:  # batches of 3
        swept += batch
    assert swept >= 4  # these four, and any another test left expired
    assert await decisions_left(db, agent) == 1, "the live decision stays"
    assert await confirmation_states(db, agent) == ["burned", "burned"]

    # A swept decision authorizes nothing, and its id cannot be registered again.
    request, decision = expired[0]
    stale = await refused(authorize(api, request, decision))
    assert stale.code == "STALE_CAPABILITY_AUTHORIZATION"
    assert "consumed or burned" in stale.message
    again = policy(request, decision.decision_id)
    assert (await refused(register(api, request, again))).code == "CAPABILITY_DECISION_REUSED"
    # The live one still authorizes, once.
    assert (await authorize(api, live_request, live)).decision_id == live.decision_id


async def test_sweepers_racing_authorizers_delete_each_expired_decision_once(fresh_database: str) -> None:
    """Four sweepers, each on a connection pool of its own, race an Authorize of every expired
    decision: each decision is deleted exactly once (by a sweeper, or burned by its Authorize),
    every Authorize is refused, and every confirmation ends burned. A database of its own: the
    sweepers delete every expired decision, and the shared one has other tests' expiring."""
    n = 40
    async with contextlib.AsyncExitStack() as stack:
        db = await stack.enter_async_context(
            migrated(fresh_database, SCHEMA, MIGRATIONS_DIR, "authz-sweep-race")
        )
        sweepers = [
            await stack.enter_async_context(
                migrated(fresh_database, SCHEMA, MIGRATIONS_DIR, f"sweeper-{i}", max_size=1)
            )
            for i in range(4)
        ]
        registry = CollectorRegistry()
        api = AuthzApi(store=AuthzStore(db), bus=None, metrics=AuthzMetrics(registry))
        agent = str(uuid.uuid4())
        await connect(api, agent, "acct-1", "v1")
        expired = await expired_decisions(api, db, agent, n)

        async def sweep(database: Database) -> int:
            store = AuthzStore(database)
            total = 0
            while (batch := await store.sweep_expired_decisions(0, 4)) > 0:
                total += batch
            return total

        outcomes = await asyncio.gather(
            *(sweep(sweeper) for sweeper in sweepers),
            *(refused(authorize(api, request, decision)) for request, decision in expired),
        )
        swept = sum(o for o in outcomes[: len(sweepers)] if isinstance(o, int))
        refusals = outcomes[len(sweepers) :]
        assert len(refusals) == n
        assert {r.code for r in refusals if isinstance(r, ParleyError)} == {"STALE_CAPABILITY_AUTHORIZATION"}
        burned_by_authorize = int(burned(registry, "expired") or 0)
        assert swept + burned_by_authorize == n, (swept, burned_by_authorize)
        assert await decisions_left(db, agent) == 0
        assert await confirmation_states(db, agent) == ["burned"] * (n // 2)
