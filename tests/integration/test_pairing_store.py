"""The pairing API and its SQL against a real PostgreSQL: the spec's behaviour, statement by statement.

Each test works on agents of its own (fresh UUIDs), which is also the proof of
tenant isolation. The replicas-over-NATS races are in tests/e2e/test_pairing.py.
"""

from __future__ import annotations

import asyncio
import secrets
import struct
import uuid
from collections.abc import AsyncIterator, Iterator
from datetime import timedelta
from typing import Any

import grpc
import psycopg
import pytest
from prometheus_client import CollectorRegistry

from parley.v1 import pairing_pb2, pairing_pb2_grpc
from parley_devinfra.infra import free_port
from parley_pairing.api import PairingApi, PairingMetrics
from parley_pairing.callout import Kicker
from parley_pairing.connectors_api import ConnectorsApi
from parley_pairing.store import MIGRATIONS_DIR, SCHEMA, ConnectorStore, PairingStore, Q
from parley_platform.errors import InvalidArgument, NotFound, Unavailable
from parley_platform.grpcserver import error_from_rpc_error, start_grpc_server
from parley_platform.postgres import Database, migrate
from parley_platform.service import Combined, grpc_binding
from parley_platform.testing import create_database, drop_database
from support import SessionEnv

TTL = 3600.0
P = pairing_pb2


@pytest.fixture(scope="module")
async def db(test_env: SessionEnv) -> AsyncIterator[Database]:
    await migrate(test_env.database_url, SCHEMA, MIGRATIONS_DIR)
    database = Database(test_env.database_url, name="pairing-tests", min_size=1, max_size=8)
    await database.open()
    yield database
    await database.close()


@pytest.fixture
def registry() -> CollectorRegistry:
    return CollectorRegistry()


@pytest.fixture
def api(db: Database, registry: CollectorRegistry) -> PairingApi:
    return PairingApi(PairingStore(db, ttl_seconds=TTL, max_pending=3), PairingMetrics(registry))


@pytest.fixture
def agent() -> str:
    return str(uuid.uuid4())


async def upsert(api: PairingApi, agent: str, sender: str, channel: str = "discord", **meta: str) -> Any:
    return await api.UpsertRequest(
        P.UpsertRequestRequest(agent_id=agent, channel=channel, sender_id=sender, metadata=meta)
    )


async def pending(api: PairingApi, agent: str, channel: str = "discord", **page: int) -> Any:
    return await api.ListPendingRequestsPage(
        P.ListPendingRequestsPageRequest(agent_id=agent, channel=channel, **page)
    )


async def allowlist(api: PairingApi, agent: str, channel: str = "discord", **page: int) -> Any:
    return await api.GetAllowlistPage(P.GetAllowlistPageRequest(agent_id=agent, channel=channel, **page))


async def age(db: Database, agent: str, seconds: float, sender: str | None = None) -> None:
    """Move requests into the past: what the TTL sees after `seconds` have passed."""
    await db.execute(
        "UPDATE pairing.request SET created_at = created_at - %(by)s, last_seen_at = last_seen_at - %(by)s"
        " WHERE agent_id = %(agent)s AND (%(sender)s::text IS NULL OR sender_id = %(sender)s)",
        {"by": timedelta(seconds=seconds), "agent": uuid.UUID(agent), "sender": sender},
    )


def sample(registry: CollectorRegistry, name: str, **labels: str) -> float:
    return registry.get_sample_value(name, labels) or 0.0


# --- upsert ----------------------------------------------------------------------------------------


async def test_a_new_sender_gets_a_code_and_a_known_one_gets_the_same_code_back(
    api: PairingApi, db: Database, agent: str, registry: CollectorRegistry
) -> None:
    first = await upsert(api, agent, "alice", name="Alice")
    assert first.created
    assert first.outcome == P.UPSERT_OUTCOME_CREATED
    request = first.request
    assert (request.agent_id, request.channel, request.sender_id) == (agent, "discord", "alice")
    assert len(request.code) == 8
    assert dict(request.metadata) == {"name": "Alice"}
    ttl = request.expires_at.ToDatetime() - request.created_at.ToDatetime()
    assert ttl == timedelta(seconds=TTL)

    await age(db, agent, 60)
    again = await upsert(api, agent, "alice", locale="fr")
    assert not again.created
    assert again.outcome == P.UPSERT_OUTCOME_EXISTING
    assert (again.request.id, again.request.code) == (request.id, request.code)
    assert again.request.last_seen_at.ToDatetime() > again.request.created_at.ToDatetime()
    assert dict(again.request.metadata) == {"name": "Alice", "locale": "fr"}
    assert sample(registry, "parley_pairing_requests_total", channel="discord", outcome="created") == 1
    assert sample(registry, "parley_pairing_requests_total", channel="discord", outcome="existing") == 1


async def test_a_full_channel_gives_no_code_and_evicts_nothing(
    api: PairingApi, agent: str, registry: CollectorRegistry
) -> None:
    codes = {(await upsert(api, agent, f"s{i}")).request.code for i in range(3)}
    full = await upsert(api, agent, "late")
    assert not full.created
    assert full.outcome == P.UPSERT_OUTCOME_FULL
    assert not full.HasField("request")
    page = await pending(api, agent)
    assert {r.code for r in page.items} == codes
    assert "late" not in {r.sender_id for r in page.items}
    # Other channels and other agents have their own limits.
    assert (await upsert(api, agent, "late", channel="telegram")).created
    assert (await upsert(api, str(uuid.uuid4()), "late")).created
    # A known sender of a full channel still gets its code.
    assert (await upsert(api, agent, "s1")).outcome == P.UPSERT_OUTCOME_EXISTING
    assert sample(registry, "parley_pairing_requests_total", channel="discord", outcome="full") == 1


async def test_codes_are_unique_per_agent_by_constraint(db: Database, agent: str, api: PairingApi) -> None:
    taken = (await upsert(api, agent, "alice")).request.code
    with pytest.raises(psycopg.errors.UniqueViolation):
        async with await psycopg.AsyncConnection.connect(db.url, autocommit=True) as conn:
            await conn.execute(
                "INSERT INTO pairing.request (agent_id, channel, sender_id, code, slot)"
                " VALUES (%s, 'telegram', 'bob', %s, 1)",
                (uuid.UUID(agent), taken),
            )


# --- TTL -------------------------------------------------------------------------------------------


async def test_an_expired_request_is_invisible_everywhere(api: PairingApi, db: Database, agent: str) -> None:
    expired = (await upsert(api, agent, "old")).request
    live = (await upsert(api, agent, "new")).request
    await age(db, agent, TTL + 1, sender="old")

    assert [r.sender_id for r in (await pending(api, agent)).items] == ["new"]
    for method, request in [
        (api.ApproveCode, P.ApproveCodeRequest(agent_id=agent, channel="discord", code=expired.code)),
        (api.DenyCode, P.DenyCodeRequest(agent_id=agent, channel="discord", code=expired.code)),
    ]:
        with pytest.raises(NotFound) as caught:
            await method(request)  # type: ignore[operator]
        assert caught.value.code == "CODE_NOT_FOUND"
    claim = await api.ClaimPairingReply(
        P.ClaimPairingReplyRequest(agent_id=agent, channel="discord", sender_id="old")
    )
    assert claim.code == ""
    assert not (
        await api.IsAllowed(P.IsAllowedRequest(agent_id=agent, channel="discord", sender_id="old"))
    ).allowed

    # The sender asks again: a new request and a new code, not the expired one.
    again = await upsert(api, agent, "old")
    assert again.created
    assert again.request.code != expired.code
    assert again.request.id != expired.id
    assert {r.sender_id for r in (await pending(api, agent)).items} == {"old", "new"}
    assert live.code in {r.code for r in (await pending(api, agent)).items}


async def test_an_expired_request_frees_its_slot(api: PairingApi, db: Database, agent: str) -> None:
    for i in range(3):
        await upsert(api, agent, f"s{i}")
    assert (await upsert(api, agent, "waiting")).outcome == P.UPSERT_OUTCOME_FULL
    await age(db, agent, TTL + 1, sender="s0")
    assert (await upsert(api, agent, "waiting")).created
    assert (await upsert(api, agent, "another")).outcome == P.UPSERT_OUTCOME_FULL
    assert {r.sender_id for r in (await pending(api, agent)).items} == {"s1", "s2", "waiting"}


async def test_the_sweep_deletes_only_expired_rows(api: PairingApi, db: Database, agent: str) -> None:
    store = api.store
    await upsert(api, agent, "keep")
    await upsert(api, agent, "drop")
    await api.ClaimPairingReply(
        P.ClaimPairingReplyRequest(agent_id=agent, channel="discord", sender_id="drop")
    )
    await age(db, agent, TTL + 1, sender="drop")
    await db.execute(
        "UPDATE pairing.reply_claim SET claimed_at = claimed_at - interval '2 hours' WHERE agent_id = %s",
        (uuid.UUID(agent),),
    )
    requests, claims = await store.purge(batch=1)
    assert requests >= 1
    assert claims >= 1
    left = await db.fetchall("SELECT sender_id FROM pairing.request WHERE agent_id = %s", (uuid.UUID(agent),))
    assert [r["sender_id"] for r in left] == ["keep"]
    assert (
        await db.fetchall("SELECT 1 FROM pairing.reply_claim WHERE agent_id = %s", (uuid.UUID(agent),)) == []
    )
    assert (await store.pending_counts()).get("discord", 0) >= 1


# --- approve, deny, allowlist ----------------------------------------------------------------------


async def test_a_lower_case_code_with_spaces_approves(
    api: PairingApi, agent: str, registry: CollectorRegistry
) -> None:
    request = (await upsert(api, agent, "alice", name="Alice")).request
    typed = f"  {request.code[:4].lower()} {request.code[4:].lower()} "
    approved = await api.ApproveCode(
        P.ApproveCodeRequest(agent_id=agent, channel="discord", code=typed, approved_by="ops")
    )
    assert approved.request.id == request.id
    assert (approved.entry.sender_id, approved.entry.channel, approved.entry.added_by) == (
        "alice",
        "discord",
        "ops",
    )
    assert dict(approved.entry.metadata) == {"name": "Alice"}
    assert (
        await api.IsAllowed(P.IsAllowedRequest(agent_id=agent, channel="discord", sender_id="alice"))
    ).allowed
    assert (await pending(api, agent)).items == []
    assert sample(registry, "parley_pairing_approvals_total") == 1
    with pytest.raises(NotFound):
        await api.ApproveCode(P.ApproveCodeRequest(agent_id=agent, channel="discord", code=request.code))


async def test_a_code_approves_only_in_its_own_agent_and_channel(api: PairingApi, agent: str) -> None:
    code = (await upsert(api, agent, "alice")).request.code
    for other_agent, channel in [(str(uuid.uuid4()), "discord"), (agent, "telegram")]:
        with pytest.raises(NotFound):
            await api.ApproveCode(P.ApproveCodeRequest(agent_id=other_agent, channel=channel, code=code))
    assert [r.code for r in (await pending(api, agent)).items] == [code]


async def test_approval_keeps_an_existing_allowlist_entry(api: PairingApi, agent: str) -> None:
    # Added by hand, then the sender asks (a request of an allowed sender is unusual but possible).
    added = await api.AddToAllowlist(
        P.AddToAllowlistRequest(agent_id=agent, channel="discord", sender_id="bob")
    )
    code = (await upsert(api, agent, "bob")).request.code
    approved = await api.ApproveCode(P.ApproveCodeRequest(agent_id=agent, channel="discord", code=code))
    assert approved.entry.id == added.entry.id
    assert approved.entry.created_at == added.entry.created_at
    assert approved.entry.added_by == "operator"


async def test_deny_deletes_the_request_and_the_sender_may_ask_again(api: PairingApi, agent: str) -> None:
    first = (await upsert(api, agent, "alice")).request
    denied = await api.DenyCode(P.DenyCodeRequest(agent_id=agent, channel="discord", code=first.code.lower()))
    assert denied.request.sender_id == "alice"
    assert (await pending(api, agent)).items == []
    assert not (
        await api.IsAllowed(P.IsAllowedRequest(agent_id=agent, channel="discord", sender_id="alice"))
    ).allowed
    with pytest.raises(NotFound):
        await api.DenyCode(P.DenyCodeRequest(agent_id=agent, channel="discord", code=first.code))
    again = await upsert(api, agent, "alice")
    assert again.created
    assert again.request.code != first.code


async def test_allowlist_add_is_idempotent_and_remove_reports_whether_it_existed(
    api: PairingApi, agent: str
) -> None:
    await upsert(api, agent, "alice")
    add = P.AddToAllowlistRequest(agent_id=agent, channel="discord", sender_id="alice", added_by="ops")
    first = await api.AddToAllowlist(add)
    second = await api.AddToAllowlist(
        P.AddToAllowlistRequest(agent_id=agent, channel="discord", sender_id="alice")
    )
    assert first.created
    assert not second.created
    assert second.entry == first.entry
    assert first.entry.id == str(uuid.UUID(first.entry.id))
    # Deterministic: the same (agent, channel, sender) has the same id after removal and re-adding.
    assert (await pending(api, agent)).items == [], "being allowed withdraws the pending request"
    remove = P.RemoveFromAllowlistRequest(agent_id=agent, channel="discord", sender_id="alice")
    assert (await api.RemoveFromAllowlist(remove)).existed
    assert not (await api.RemoveFromAllowlist(remove)).existed
    assert not (
        await api.IsAllowed(P.IsAllowedRequest(agent_id=agent, channel="discord", sender_id="alice"))
    ).allowed
    readded = await api.AddToAllowlist(add)
    assert readded.created
    assert readded.entry.id == first.entry.id
    other = await api.AddToAllowlist(
        P.AddToAllowlistRequest(agent_id=agent, channel="telegram", sender_id="alice")
    )
    assert other.entry.id != first.entry.id


async def test_is_allowed_counts_denied_messages(
    api: PairingApi, agent: str, registry: CollectorRegistry
) -> None:
    ask = P.IsAllowedRequest(agent_id=agent, channel="discord", sender_id="alice")
    assert not (await api.IsAllowed(ask)).allowed
    assert not (await api.IsAllowed(ask)).allowed
    await api.AddToAllowlist(P.AddToAllowlistRequest(agent_id=agent, channel="discord", sender_id="alice"))
    assert (await api.IsAllowed(ask)).allowed
    assert sample(registry, "parley_pairing_denied_messages_total") == 2


# --- reply claims ----------------------------------------------------------------------------------


async def test_the_pairing_reply_is_claimed_once_per_ttl_window(
    api: PairingApi, db: Database, agent: str
) -> None:
    code = (await upsert(api, agent, "alice")).request.code
    claim = P.ClaimPairingReplyRequest(agent_id=agent, channel="discord", sender_id="alice")
    first = await api.ClaimPairingReply(claim)
    assert (first.claimed, first.code) == (True, code)
    for _ in range(3):
        later = await api.ClaimPairingReply(claim)
        assert (later.claimed, later.code) == (False, code)
    # A window later (the request is still pending): told once more.
    await db.execute(
        "UPDATE pairing.reply_claim SET claimed_at = claimed_at - %s WHERE agent_id = %s",
        (timedelta(seconds=TTL + 1), uuid.UUID(agent)),
    )
    assert (await api.ClaimPairingReply(claim)).claimed
    assert not (await api.ClaimPairingReply(claim)).claimed


async def test_a_new_code_is_told_once_more(api: PairingApi, agent: str) -> None:
    claim = P.ClaimPairingReplyRequest(agent_id=agent, channel="discord", sender_id="d")
    for i in range(3):
        await upsert(api, agent, f"s{i}")
    assert (await upsert(api, agent, "d")).outcome == P.UPSERT_OUTCOME_FULL
    full = await api.ClaimPairingReply(claim)
    assert (full.claimed, full.code) == (True, "")
    assert not (await api.ClaimPairingReply(claim)).claimed
    # A slot frees up: the sender's new code is worth telling, once.
    await api.DenyCode(
        P.DenyCodeRequest(
            agent_id=agent, channel="discord", code=(await upsert(api, agent, "s0")).request.code
        )
    )
    code = (await upsert(api, agent, "d")).request.code
    told = await api.ClaimPairingReply(claim)
    assert (told.claimed, told.code) == (True, code)
    assert not (await api.ClaimPairingReply(claim)).claimed


async def test_concurrent_claims_on_separate_connections_have_one_winner(
    test_env: SessionEnv, api: PairingApi, agent: str
) -> None:
    await upsert(api, agent, "chatty")
    databases = [
        Database(test_env.database_url, name=f"claim-{i}", min_size=1, max_size=1) for i in range(10)
    ]
    await asyncio.gather(*(d.open() for d in databases))
    try:
        stores = [PairingStore(d, ttl_seconds=TTL, max_pending=3) for d in databases]
        results = await asyncio.gather(
            *(s.claim_reply(uuid.UUID(agent), "discord", "chatty") for s in stores)
        )
    finally:
        await asyncio.gather(*(d.close() for d in databases))
    assert sum(claimed for claimed, _ in results) == 1
    assert len({code for _, code in results}) == 1


# --- pages -----------------------------------------------------------------------------------------


async def same_instant(db: Database, table: str, agent: str) -> None:
    await db.execute(
        f"UPDATE pairing.{table} SET created_at = date_trunc('second', now()) WHERE agent_id = %s",
        (uuid.UUID(agent),),
    )


@pytest.mark.parametrize(
    ("page", "field", "mentions"),
    [
        ({"limit": 0}, "limit", "got 0"),
        ({"limit": 101}, "limit", "got 101"),
        ({"limit": -1}, "limit", "got -1"),
        ({"offset": -1}, "offset", "got -1"),
        ({"limit": 2**40}, "limit", f"got {2**40}"),
    ],
)
async def test_out_of_range_pages_are_invalid(
    api: PairingApi, agent: str, page: dict[str, int], field: str, mentions: str
) -> None:
    for call in (pending, allowlist):
        with pytest.raises(InvalidArgument) as caught:
            await call(api, agent, **page)
        assert caught.value.code == "INVALID_PAGE"
        assert caught.value.message.startswith(f"{field} must be an integer")
        assert mentions in caught.value.message


async def test_a_non_integer_limit_on_the_wire_is_invalid(api: PairingApi, agent: str) -> None:
    base = P.ListPendingRequestsPageRequest(agent_id=agent, channel="discord").SerializeToString()
    decoded = P.ListPendingRequestsPageRequest.FromString(base + bytes([3 << 3 | 1]) + struct.pack("<d", 1.5))
    with pytest.raises(InvalidArgument, match="limit must be an integer from 1 to 100"):
        await api.ListPendingRequestsPage(decoded)


async def test_defaults_and_the_last_page(api: PairingApi, agent: str) -> None:
    await upsert(api, agent, "a")
    page = await pending(api, agent)
    assert (page.limit, page.offset, page.has_more, page.HasField("next_offset")) == (50, 0, False, False)
    assert [r.sender_id for r in page.items] == ["a"]
    beyond = await pending(api, agent, offset=10)
    assert (beyond.items, beyond.has_more, beyond.HasField("next_offset")) == ([], False, False)


@pytest.mark.parametrize("table", ["request", "allowlist"])
async def test_pages_are_newest_first_with_the_id_breaking_ties(
    test_env: SessionEnv, db: Database, table: str
) -> None:
    agent = str(uuid.uuid4())
    api = PairingApi(PairingStore(db, ttl_seconds=TTL, max_pending=20), PairingMetrics(CollectorRegistry()))
    for i in range(7):
        if table == "request":
            await upsert(api, agent, f"s{i}")
        else:
            await api.AddToAllowlist(
                P.AddToAllowlistRequest(agent_id=agent, channel="discord", sender_id=f"s{i}")
            )
    list_page = pending if table == "request" else allowlist
    newest_first = [item.sender_id for item in (await list_page(api, agent)).items]
    assert newest_first == [f"s{i}" for i in reversed(range(7))]

    await same_instant(db, table, agent)
    whole = (await list_page(api, agent, limit=100)).items
    assert [item.id for item in whole] == sorted((item.id for item in whole), reverse=True)

    walked: list[str] = []
    offsets = []
    offset = 0
    while True:
        page = await list_page(api, agent, limit=3, offset=offset)
        offsets.append((page.offset, page.limit, len(page.items), page.has_more))
        walked += [item.id for item in page.items]
        if not page.has_more:
            assert not page.HasField("next_offset")
            break
        assert page.next_offset == offset + 3
        offset = page.next_offset
    assert walked == [item.id for item in whole]
    assert offsets == [(0, 3, 3, True), (3, 3, 3, True), (6, 3, 1, False)]

    # A last page that is exactly full has no next page either.
    exact = await list_page(api, agent, limit=7)
    assert (len(exact.items), exact.has_more, exact.HasField("next_offset")) == (7, False, False)
    first_of_six = await list_page(api, agent, limit=6)
    assert (first_of_six.has_more, first_of_six.next_offset) == (True, 6)


async def test_expired_requests_take_no_page_slots(db: Database) -> None:
    agent = str(uuid.uuid4())
    api = PairingApi(PairingStore(db, ttl_seconds=TTL, max_pending=20), PairingMetrics(CollectorRegistry()))
    for i in range(6):
        await upsert(api, agent, f"s{i}")
    for i in (4, 5):  # the newest two expire
        await age(db, agent, TTL + 1, sender=f"s{i}")
    page = await pending(api, agent, limit=2)
    assert [r.sender_id for r in page.items] == ["s3", "s2"]
    assert page.has_more
    last = await pending(api, agent, limit=2, offset=2)
    assert [r.sender_id for r in last.items] == ["s1", "s0"]
    assert not last.has_more


# --- validation before any read --------------------------------------------------------------------


@pytest.fixture
async def unreachable_api() -> AsyncIterator[Combined]:
    """The API (pairing and connectors, as the service serves them) on a database that does not
    answer: any storage read would be UNAVAILABLE."""
    database = Database(
        f"postgresql://parley@127.0.0.1:{free_port()}/parley", name="down", min_size=1, max_size=1
    )
    yield Combined(
        PairingApi(
            PairingStore(database, ttl_seconds=TTL, max_pending=3), PairingMetrics(CollectorRegistry())
        ),
        ConnectorsApi(ConnectorStore(database), Kicker(None), "parley"),
    )
    await database.close()


async def test_bad_input_is_refused_before_any_storage_read(unreachable_api: Combined) -> None:
    agent = str(uuid.uuid4())
    token = secrets.token_urlsafe(16)
    port = free_port()
    server = await start_grpc_server(
        [grpc_binding(unreachable_api, pairing_pb2, "Pairing")],
        host="127.0.0.1",
        port=port,
        token=token,
    )
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = pairing_pb2_grpc.PairingStub(channel)
            metadata = [("authorization", f"Bearer {token}")]
            bad: list[tuple[Any, Any, str]] = [
                (
                    stub.ListPendingRequestsPage,
                    P.ListPendingRequestsPageRequest(agent_id=agent, channel="d", limit=0),
                    "limit",
                ),
                (
                    stub.ListPendingRequestsPage,
                    P.ListPendingRequestsPageRequest(agent_id=agent, channel="d", limit=101),
                    "limit",
                ),
                (
                    stub.GetAllowlistPage,
                    P.GetAllowlistPageRequest(agent_id=agent, channel="d", offset=-1),
                    "offset",
                ),
                (
                    stub.GetAllowlistPage,
                    P.GetAllowlistPageRequest(agent_id="default", channel="d"),
                    "agent_id",
                ),
                (stub.UpsertRequest, P.UpsertRequestRequest(agent_id=agent, channel="d"), "sender_id"),
                (
                    stub.UpsertRequest,
                    P.UpsertRequestRequest(agent_id=agent, channel="d d", sender_id="s"),
                    "channel",
                ),
                (
                    stub.ApproveCode,
                    P.ApproveCodeRequest(agent_id=agent, channel="d", code="0000OOOO"),
                    "code",
                ),
                (stub.DenyCode, P.DenyCodeRequest(agent_id=agent, channel="d"), "code"),
                (stub.IsAllowed, P.IsAllowedRequest(agent_id=agent, sender_id="s"), "channel"),
                (stub.AddToAllowlist, P.AddToAllowlistRequest(channel="d", sender_id="s"), "agent_id"),
                (
                    stub.RemoveFromAllowlist,
                    P.RemoveFromAllowlistRequest(agent_id=agent, channel="d", sender_id="\x01"),
                    "sender_id",
                ),
                (
                    stub.ClaimPairingReply,
                    P.ClaimPairingReplyRequest(agent_id=agent, channel="d"),
                    "sender_id",
                ),
                (stub.AddConnector, P.AddConnectorRequest(name="a b", agent_id=agent, source="t"), "name"),
                (stub.AddConnector, P.AddConnectorRequest(name="ab", agent_id=agent, source="t.x"), "source"),
                (stub.AddConnector, P.AddConnectorRequest(name="ab", agent_id="x", source="t"), "agent_id"),
                (stub.RevokeConnector, P.RevokeConnectorRequest(name=""), "name"),
            ]
            for method, request, field in bad:
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    await method(request, metadata=metadata, timeout=10)
                assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (
                    request,
                    caught.value.details(),
                )
                assert field in (caught.value.details() or "")
            # The same calls with good input do reach the (absent) database.
            with pytest.raises(grpc.aio.AioRpcError) as down:
                await stub.ListPendingRequestsPage(
                    P.ListPendingRequestsPageRequest(agent_id=agent, channel="d", limit=100),
                    metadata=metadata,
                    timeout=10,
                )
            assert down.value.code() == grpc.StatusCode.UNAVAILABLE
            assert isinstance(error_from_rpc_error(down.value), Unavailable)
    finally:
        await server.stop(0)


# --- 100,000 rows ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def big_database(test_env: SessionEnv) -> Iterator[str]:
    name = f"parley_pairing_big_{secrets.token_hex(4)}"
    url = create_database(test_env.server_database_url, name)
    yield url
    drop_database(test_env.server_database_url, name)


async def test_pages_use_their_index_on_100000_rows(big_database: str) -> None:
    await migrate(big_database, SCHEMA, MIGRATIONS_DIR)
    agent = uuid.uuid4()
    async with await psycopg.AsyncConnection.connect(big_database, autocommit=True) as conn:
        # 100,000 live requests and allowlist entries of one agent and channel (the worst case for
        # its pages), beside 2,000 of other agents.
        await conn.execute(
            "INSERT INTO pairing.request (agent_id, channel, sender_id, code, slot, created_at)"
            " SELECT CASE WHEN g <= 100000 THEN %(agent)s ELSE gen_random_uuid() END, 'discord',"
            "        's' || g, translate(lpad(to_hex(g), 8, '0'), '01abcdef', 'ABCDEFGH'), g,"
            "        now() - g * interval '1 ms'"
            "   FROM generate_series(1, 102000) g",
            {"agent": agent},
        )
        await conn.execute(
            "INSERT INTO pairing.allowlist (agent_id, channel, sender_id, added_by, created_at)"
            " SELECT CASE WHEN g <= 100000 THEN %(agent)s ELSE gen_random_uuid() END, 'discord',"
            "        's' || g, 'seed', now() - g * interval '1 ms'"
            "   FROM generate_series(1, 102000) g",
            {"agent": agent},
        )
        await conn.execute("ANALYZE pairing.request, pairing.allowlist")
    database = Database(big_database, name="big", min_size=1, max_size=2)
    await database.open()
    try:
        api = PairingApi(
            PairingStore(database, ttl_seconds=TTL, max_pending=3), PairingMetrics(CollectorRegistry())
        )
        first = await pending(api, str(agent), limit=100)
        assert [r.sender_id for r in first.items] == [f"s{g}" for g in range(1, 101)]
        last = await allowlist(api, str(agent), limit=100, offset=99_950)
        assert [e.sender_id for e in last.items] == [f"s{g}" for g in range(99_951, 100_001)]
        assert not last.has_more

        async with database.connection() as conn:
            await conn.execute("SET plan_cache_mode = force_custom_plan")
            for query, index in [("pending_page", "request_page"), ("allowlist_page", "allowlist_page")]:
                params = {"agent_id": agent, "channel": "discord", "ttl": TTL, "limit": 101, "offset": 0}
                cur = await conn.execute(("EXPLAIN " + Q[query]).encode(), params)
                plan = "\n".join(row[0] for row in await cur.fetchall())
                assert f"Index Scan using {index}" in plan, plan
                assert "Sort" not in plan, plan
    finally:
        await database.close()
