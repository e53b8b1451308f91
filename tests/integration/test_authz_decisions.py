"""Tool-call decisions against real Postgres and NATS: put-pending, decide with idempotent replay and
typed errors, settle with the claim token, expiry, stuck claims, lists and the decision events."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest
from google.protobuf.timestamp_pb2 import Timestamp
from nats.aio.msg import Msg
from prometheus_client import CollectorRegistry

from parley.v1 import authz_pb2, common_pb2
from parley_authz.api import AuthzApi
from parley_authz.metrics import AuthzMetrics
from parley_authz.store import MIGRATIONS_DIR, SCHEMA, AuthzStore
from parley_platform.bus import Bus
from parley_platform.canonical import InvalidContract, tool_arguments_digest
from parley_platform.errors import Conflict, FailedPrecondition, InvalidArgument, NotFound
from parley_platform.postgres import Database, migrate
from parley_platform.testing import eventually
from support import SessionEnv

ARGS = tool_arguments_digest({"to": "bob@example.com"})


@pytest.fixture(scope="module")
async def db(test_env: SessionEnv) -> AsyncIterator[Database]:
    await migrate(test_env.database_url, SCHEMA, MIGRATIONS_DIR)
    database = Database(test_env.database_url, name="authz-test", min_size=1, max_size=4)
    await database.open()
    yield database
    await database.close()


@pytest.fixture
async def api(db: Database, bus: Bus) -> AsyncIterator[AuthzApi]:
    service = AuthzApi(store=AuthzStore(db), bus=bus, metrics=AuthzMetrics(CollectorRegistry()))
    yield service
    await service.aclose()


@pytest.fixture
def agent() -> str:
    return str(uuid.uuid4())


def at(delta: timedelta) -> Timestamp:
    stamp = Timestamp()
    stamp.FromDatetime(datetime.now(UTC) + delta)
    return stamp


async def put(api: AuthzApi, agent: str, tool_call_id: str, **fields: Any) -> authz_pb2.PutPendingResponse:
    request = authz_pb2.PutPendingRequest(
        agent_id=agent,
        tool_call_id=tool_call_id,
        conversation_id=fields.pop("conversation_id", "room-1"),
        message_id=fields.pop("message_id", f"msg-{tool_call_id}"),
        call_index=fields.pop("call_index", 0),
        tool=fields.pop("tool", "SEND_EMAIL"),
        args_digest=fields.pop("args_digest", ARGS),
        summary=fields.pop("summary", "send an email to bob"),
        **fields,
    )
    return await api.PutPending(request)


async def decide(
    api: AuthzApi, agent: str, tool_call_id: str, decision: str, reason: str = "", by: str = "op"
) -> authz_pb2.DecideResponse:
    value = authz_pb2.TOOL_DECISION_APPROVE if decision == "approve" else authz_pb2.TOOL_DECISION_DENY
    return await api.Decide(
        authz_pb2.DecideRequest(
            agent_id=agent, tool_call_id=tool_call_id, decision=value, reason=reason, decided_by=by
        )
    )


async def settle(
    api: AuthzApi, agent: str, tool_call_id: str, token: str, outcome: int = authz_pb2.TOOL_OUTCOME_SUCCESS
) -> authz_pb2.ToolCall:
    return await api.Settle(
        authz_pb2.SettleRequest(
            agent_id=agent,
            tool_call_id=tool_call_id,
            claim_token=token,
            outcome=outcome,  # type: ignore[arg-type]
            result='{"sent": true}',
            settled_by="runtime",
        )
    )


async def test_put_pending_inserts_once_and_refuses_a_reused_id(api: AuthzApi, agent: str) -> None:
    first = await put(api, agent, "call-1")
    assert first.created
    assert first.tool_call.status == authz_pb2.TOOL_CALL_STATUS_PENDING
    assert first.tool_call.on_expiry == authz_pb2.TOOL_DECISION_DENY
    again = await put(api, agent, "call-1")
    assert not again.created
    assert again.tool_call == first.tool_call

    with pytest.raises(Conflict) as reused:
        await put(api, agent, "call-1", args_digest=tool_arguments_digest({"to": "eve@example.com"}))
    assert reused.value.code == "TOOL_CALL_ID_REUSED"
    with pytest.raises(Conflict) as slot:
        await put(api, agent, "call-2", message_id="msg-call-1")
    assert slot.value.code == "TOOL_CALL_CONFLICT"


async def test_concurrent_puts_of_one_call_create_it_once(api: AuthzApi, agent: str) -> None:
    replies = await asyncio.gather(*(put(api, agent, "call-c") for _ in range(8)))
    assert sum(r.created for r in replies) == 1
    assert len({r.tool_call.SerializeToString() for r in replies}) == 1


@pytest.mark.parametrize(
    ("field", "value", "mentions"),
    [
        ("tool_call_id", "", "tool_call_id is required"),
        ("tool_call_id", "x" * 201, "tool_call_id must be 1 to 200"),
        ("args_digest", "not-a-digest", "args_digest must be a SHA-256 digest"),
        ("tool", "send email!", "tool must start with a letter"),
        ("summary", "s" * 2001, "summary must be at most 2000"),
        ("summary", "a\x00b", "summary must not contain NUL characters"),
    ],
)
async def test_put_pending_names_the_bad_field(
    api: AuthzApi, agent: str, field: str, value: str, mentions: str
) -> None:
    request = authz_pb2.PutPendingRequest(
        agent_id=agent,
        tool_call_id="call-v",
        conversation_id="room",
        message_id="m",
        tool="SEND_EMAIL",
        args_digest=ARGS,
    )
    setattr(request, field, value)
    with pytest.raises(InvalidArgument) as caught:
        await api.PutPending(request)
    assert mentions in caught.value.message
    assert "not-a-digest" not in caught.value.message


async def test_agent_must_be_a_uuid_and_other_agents_see_nothing(api: AuthzApi, agent: str) -> None:
    with pytest.raises(InvalidArgument, match="agent_id must be a UUID"):
        await api.GetToolCall(authz_pb2.GetToolCallRequest(agent_id="default", tool_call_id="x"))
    await put(api, agent, "mine")
    other = str(uuid.uuid4())
    with pytest.raises(NotFound) as caught:
        await api.GetToolCall(authz_pb2.GetToolCallRequest(agent_id=other, tool_call_id="mine"))
    assert caught.value.code == "ACTION_NOT_FOUND"
    with pytest.raises(NotFound):
        await decide(api, other, "mine", "approve")
    pending = await api.ListPendingToolCalls(authz_pb2.ListPendingToolCallsRequest(agent_id=other))
    assert list(pending.tool_calls) == []


async def test_a_reason_with_a_nul_character_is_refused_and_the_call_stays_pending(
    api: AuthzApi, agent: str
) -> None:
    await put(api, agent, "call-nul")
    with pytest.raises(InvalidArgument, match="reason must not contain NUL characters"):
        await decide(api, agent, "call-nul", "approve", reason="ok\x00then")
    call = await api.GetToolCall(authz_pb2.GetToolCallRequest(agent_id=agent, tool_call_id="call-nul"))
    assert call.status == authz_pb2.TOOL_CALL_STATUS_PENDING


async def test_approve_claims_once_then_replays_and_settles_with_its_token(api: AuthzApi, agent: str) -> None:
    await put(api, agent, "call-a")
    won = await decide(api, agent, "call-a", "approve")
    assert won.result == authz_pb2.DECIDE_RESULT_CLAIMED
    assert won.tool_call.status == authz_pb2.TOOL_CALL_STATUS_CLAIMED
    token = won.tool_call.claim.token
    assert uuid.UUID(token)

    in_flight = await decide(api, agent, "call-a", "approve", by="someone-else")
    assert in_flight.result == authz_pb2.DECIDE_RESULT_IN_FLIGHT
    assert not in_flight.tool_call.HasField("claim"), "only the winner gets the claim"
    assert in_flight.tool_call.decided_by == "op"

    with pytest.raises(Conflict) as conflicting:
        await decide(api, agent, "call-a", "deny")
    assert conflicting.value.code == "ACTION_ALREADY_DECIDED"

    with pytest.raises(Conflict) as stale:
        await settle(api, agent, "call-a", str(uuid.uuid4()))
    assert stale.value.code == "STALE_CLAIM_TOKEN"
    still = await api.GetToolCall(authz_pb2.GetToolCallRequest(agent_id=agent, tool_call_id="call-a"))
    assert still.status == authz_pb2.TOOL_CALL_STATUS_CLAIMED

    settled = await settle(api, agent, "call-a", token)
    assert settled.status == authz_pb2.TOOL_CALL_STATUS_SETTLED
    assert settled.outcome == authz_pb2.TOOL_OUTCOME_SUCCESS
    assert settled.result == '{"sent": true}'
    assert await settle(api, agent, "call-a", token) == settled, "the identical settle is a replay"
    with pytest.raises(FailedPrecondition) as twice:
        await settle(api, agent, "call-a", token, authz_pb2.TOOL_OUTCOME_FAILURE)
    assert twice.value.code == "ACTION_ALREADY_SETTLED"

    recorded = await decide(api, agent, "call-a", "approve")
    assert recorded.result == authz_pb2.DECIDE_RESULT_RECORDED
    assert recorded.tool_call.outcome == authz_pb2.TOOL_OUTCOME_SUCCESS


async def test_deny_is_final_and_keeps_its_first_reason(api: AuthzApi, agent: str) -> None:
    await put(api, agent, "call-d")
    denied = await decide(api, agent, "call-d", "deny", reason="not to bob")
    assert denied.result == authz_pb2.DECIDE_RESULT_DENIED
    assert denied.tool_call.status == authz_pb2.TOOL_CALL_STATUS_SETTLED
    assert denied.tool_call.outcome == authz_pb2.TOOL_OUTCOME_DENIED
    assert not denied.tool_call.HasField("claim")

    again = await decide(api, agent, "call-d", "deny", reason="another reason")
    assert again.result == authz_pb2.DECIDE_RESULT_RECORDED
    assert again.tool_call.reason == "not to bob"
    with pytest.raises(Conflict) as caught:
        await decide(api, agent, "call-d", "approve")
    assert caught.value.code == "ACTION_ALREADY_DECIDED"
    with pytest.raises(FailedPrecondition) as unclaimed:
        await settle(api, agent, "call-d", str(uuid.uuid4()))
    assert unclaimed.value.code == "ACTION_ALREADY_SETTLED"


async def test_unknown_id_and_unclaimed_settle(api: AuthzApi, agent: str) -> None:
    with pytest.raises(NotFound) as caught:
        await decide(api, agent, "nobody", "approve")
    assert caught.value.code == "ACTION_NOT_FOUND"
    await put(api, agent, "call-u")
    with pytest.raises(FailedPrecondition) as unclaimed:
        await settle(api, agent, "call-u", str(uuid.uuid4()))
    assert unclaimed.value.code == "ACTION_NOT_CLAIMED"
    with pytest.raises(InvalidArgument, match="claim_token must be the UUID"):
        await settle(api, agent, "call-u", "secret-ish")
    with pytest.raises(InvalidArgument, match="outcome must be success, failure or indeterminate"):
        await settle(api, agent, "call-u", str(uuid.uuid4()), authz_pb2.TOOL_OUTCOME_DENIED)


async def test_expiry_settles_with_the_default_and_refuses_late_decisions(
    api: AuthzApi, agent: str, db: Database
) -> None:
    await put(api, agent, "call-e", expires_at=at(timedelta(milliseconds=300)))
    await put(
        api,
        agent,
        "call-e2",
        expires_at=at(timedelta(milliseconds=300)),
        on_expiry=authz_pb2.TOOL_DECISION_APPROVE,
    )
    await put(api, agent, "call-e3", expires_at=at(timedelta(milliseconds=300)))

    async def expired() -> bool:
        row = await db.fetchone(
            "SELECT bool_and(expires_at <= now()) AS done FROM authz.tool_call"
            " WHERE agent_id = %s AND id LIKE 'call-e%%'",
            (uuid.UUID(agent),),
        )
        return bool(row and row["done"])

    await eventually(expired, timeout=5, what="the calls to pass their expiry")
    # Not swept yet: a late decision is refused all the same.
    with pytest.raises(Conflict, match="expired") as late:
        await decide(api, agent, "call-e3", "approve")
    assert late.value.code == "ACTION_ALREADY_DECIDED"
    pending = await api.ListPendingToolCalls(authz_pb2.ListPendingToolCallsRequest(agent_id=agent))
    assert list(pending.tool_calls) == [], "an expired call is not offered to operators"

    while await api.expire_due(100):
        pass
    get = authz_pb2.GetToolCallRequest(agent_id=agent, tool_call_id="call-e")
    denied = await api.GetToolCall(get)
    assert denied.status == authz_pb2.TOOL_CALL_STATUS_SETTLED
    assert denied.outcome == authz_pb2.TOOL_OUTCOME_EXPIRED
    assert denied.decision == authz_pb2.TOOL_DECISION_DENY
    assert denied.decided_by == "expiry"
    approved = await api.GetToolCall(authz_pb2.GetToolCallRequest(agent_id=agent, tool_call_id="call-e2"))
    assert approved.status == authz_pb2.TOOL_CALL_STATUS_CLAIMED
    assert approved.decision == authz_pb2.TOOL_DECISION_APPROVE
    with pytest.raises(Conflict, match="expired"):
        await decide(api, agent, "call-e", "deny")
    assert await api.expire_due(100) == 0


async def test_expires_at_must_follow_proposed_at(api: AuthzApi, agent: str) -> None:
    with pytest.raises(InvalidArgument, match="expires_at must be after proposed_at"):
        await put(api, agent, "call-x", expires_at=at(timedelta(seconds=-1)))


async def test_lists_pending_by_conversation_with_pages(api: AuthzApi, agent: str) -> None:
    for index in range(3):
        await put(api, agent, f"p{index}", conversation_id="room-a", message_id="m-a", call_index=index)
    await put(api, agent, "q0", conversation_id="room-b", message_id="m-b")
    await decide(api, agent, "p1", "deny")

    everything = await api.ListPendingToolCalls(authz_pb2.ListPendingToolCallsRequest(agent_id=agent))
    assert [c.tool_call_id for c in everything.tool_calls] == ["p0", "p2", "q0"]
    room = await api.ListPendingToolCalls(
        authz_pb2.ListPendingToolCallsRequest(
            agent_id=agent, conversation_id="room-a", page=common_pb2.PageRequest(limit=1)
        )
    )
    assert [c.tool_call_id for c in room.tool_calls] == ["p0"]
    assert room.page.has_more
    assert room.page.next_offset == 1
    with pytest.raises(InvalidArgument, match=r"page\.limit"):
        await api.ListPendingToolCalls(
            authz_pb2.ListPendingToolCallsRequest(agent_id=agent, page=common_pb2.PageRequest(limit=500))
        )


async def test_message_tool_calls_in_call_order_and_when_to_continue(api: AuthzApi, agent: str) -> None:
    for index in (2, 0, 1):
        await put(api, agent, f"m{index}", conversation_id="room", message_id="assistant-1", call_index=index)
    request = authz_pb2.ListMessageToolCallsRequest(
        agent_id=agent, conversation_id="room", message_id="assistant-1"
    )
    listed = await api.ListMessageToolCalls(request)
    assert [c.call_index for c in listed.tool_calls] == [0, 1, 2]
    assert not listed.all_decided
    tokens = {}
    for index in range(3):
        reply = await decide(api, agent, f"m{index}", "deny" if index == 1 else "approve")
        tokens[index] = reply.tool_call.claim.token
    decided = await api.ListMessageToolCalls(request)
    assert decided.all_decided
    assert not decided.all_settled
    await settle(api, agent, "m0", tokens[0])
    await settle(api, agent, "m2", tokens[2], authz_pb2.TOOL_OUTCOME_FAILURE)
    done = await api.ListMessageToolCalls(request)
    assert done.all_settled
    assert [c.outcome for c in done.tool_calls] == [
        authz_pb2.TOOL_OUTCOME_SUCCESS,
        authz_pb2.TOOL_OUTCOME_DENIED,
        authz_pb2.TOOL_OUTCOME_FAILURE,
    ]


async def test_stuck_claims_are_listed_with_their_token_and_never_reset(
    api: AuthzApi, agent: str, db: Database
) -> None:
    await put(api, agent, "stuck-1")
    won = await decide(api, agent, "stuck-1", "approve")
    listed = await api.ListStuckToolCalls(
        authz_pb2.ListStuckToolCallsRequest(agent_id=agent, older_than_seconds=0)
    )
    assert [(c.tool_call_id, c.claim.token) for c in listed.tool_calls] == [
        ("stuck-1", won.tool_call.claim.token)
    ]
    later = await api.ListStuckToolCalls(
        authz_pb2.ListStuckToolCallsRequest(agent_id=agent, older_than_seconds=3600)
    )
    assert list(later.tool_calls) == []
    with pytest.raises(InvalidArgument, match="older_than_seconds"):
        await api.ListStuckToolCalls(
            authz_pb2.ListStuckToolCallsRequest(agent_id=agent, older_than_seconds=float("nan"))
        )
    # Nothing the service does on its own touches a claim.
    while await api.expire_due(100):
        pass
    assert (await decide(api, agent, "stuck-1", "approve")).result == authz_pb2.DECIDE_RESULT_IN_FLIGHT
    settled = await settle(
        api, agent, "stuck-1", won.tool_call.claim.token, authz_pb2.TOOL_OUTCOME_INDETERMINATE
    )
    assert settled.outcome == authz_pb2.TOOL_OUTCOME_INDETERMINATE


async def test_decisions_are_published_as_events(api: AuthzApi, agent: str, bus: Bus, db: Database) -> None:
    seen: asyncio.Queue[tuple[str, authz_pb2.ToolCallEvent]] = asyncio.Queue()

    async def on_event(msg: Msg) -> None:
        seen.put_nowait((msg.subject, authz_pb2.ToolCallEvent.FromString(msg.data)))

    sub = await bus.subscribe(bus.subjects.events(agent, "*"), on_event)
    try:
        await bus.nc.flush()
        await put(api, agent, "ev-1")
        won = await decide(api, agent, "ev-1", "approve")
        subject, claimed = await asyncio.wait_for(seen.get(), 5)
        assert subject == bus.subjects.events(agent, "TOOL_CALL_CLAIMED")
        assert claimed.type == "TOOL_CALL_CLAIMED"
        assert claimed.tool_call.claim.token == won.tool_call.claim.token
        await settle(api, agent, "ev-1", won.tool_call.claim.token)
        subject, settled = await asyncio.wait_for(seen.get(), 5)
        assert subject == bus.subjects.events(agent, "TOOL_CALL_SETTLED")
        assert settled.tool_call.outcome == authz_pb2.TOOL_OUTCOME_SUCCESS
        assert not settled.tool_call.HasField("claim")

        async def announced() -> Any:
            row = await db.fetchone(
                "SELECT announced FROM authz.tool_call WHERE agent_id = %s AND id = 'ev-1'",
                (uuid.UUID(agent),),
            )
            return row and row["announced"] == "settled"

        await eventually(announced, what="the settled event recorded as published")

        # An event lost with its replica (published, never recorded) goes out again.
        await put(api, agent, "ev-2")
        await decide(api, agent, "ev-2", "deny")
        await asyncio.wait_for(seen.get(), 5)
        await api.drain_announcements(5)
        async with await psycopg.AsyncConnection.connect(db.url, autocommit=True) as conn:
            await conn.execute(
                "UPDATE authz.tool_call SET announced = NULL WHERE agent_id = %s AND id = 'ev-2'",
                (uuid.UUID(agent),),
            )
        # Every unannounced decision in the database, not the sweeper's oldest 100: other modules'
        # tests share this database and may leave older ones behind.
        assert await api.republish(grace=0, limit=1_000_000) >= 1
        subject, again = await asyncio.wait_for(seen.get(), 5)
        assert again.tool_call.tool_call_id == "ev-2"
        assert again.tool_call.outcome == authz_pb2.TOOL_OUTCOME_DENIED
    finally:
        await sub.unsubscribe()


async def test_unknown_fields_are_refused_before_anything_happens(api: AuthzApi, agent: str) -> None:
    request = authz_pb2.DecideRequest(
        agent_id=agent, tool_call_id="x", decision=authz_pb2.TOOL_DECISION_APPROVE, decided_by="op"
    )
    extended = authz_pb2.DecideRequest.FromString(request.SerializeToString() + bytes([0xA0, 0x06, 0x01]))
    with pytest.raises(InvalidContract) as caught:
        await api.Decide(extended)
    assert "field number 100" in caught.value.message
