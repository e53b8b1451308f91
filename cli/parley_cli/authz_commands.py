"""`parley approvals list|approve|deny|stuck|settle` and `parley leases list`: the operator side of
authz, over gRPC."""

from __future__ import annotations

import getpass
from typing import Annotated, Literal

import typer

from parley.v1 import authz_pb2, authz_pb2_grpc, common_pb2

from . import client, common
from .common import Agent, Json, Limit, Offset, command, when

app = common.group("approvals", "Tool calls waiting for a person's decision (authz).")
leases = common.group("leases", "Interaction leases on shared resources (authz).")
call = client.caller("authz", authz_pb2_grpc.AuthzStub)

DECIDE_RESULTS = {
    authz_pb2.DECIDE_RESULT_CLAIMED: "approved: claimed for its executor, which runs it once and settles it",
    authz_pb2.DECIDE_RESULT_DENIED: "denied: it will not run",
    authz_pb2.DECIDE_RESULT_IN_FLIGHT: "already approved: its executor has not settled it yet",
    authz_pb2.DECIDE_RESULT_RECORDED: "already decided the same way",
}
ToolCallId = Annotated[str, typer.Argument(metavar="TOOL_CALL_ID", help="the tool call's id")]
By = Annotated[str, typer.Option(metavar="WHO", help="who decided (default: operator:<your user>)")]


def _operator(by: str) -> str:
    if by:
        return by
    try:
        return f"operator:{getpass.getuser()}"
    except (KeyError, OSError):
        return "operator"


@command(app, "list")
async def list_pending(
    agent: Agent = "default",
    conversation: str = typer.Option("", metavar="ROOM_ID", help="only this conversation (room)"),
    limit: Limit = 50,
    offset: Offset = 0,
    json: Json = False,
) -> None:
    """Pending approvals, oldest first."""
    page = common_pb2.PageRequest(limit=limit, offset=offset)
    request = authz_pb2.ListPendingToolCallsRequest(
        agent_id=await client.agent_id(agent), conversation_id=conversation, page=page
    )
    reply = await call("ListPendingToolCalls", request)
    common.listing(
        json,
        reply.tool_calls,
        reply.page,
        ["ID", "TOOL", "CONVERSATION", "PROPOSED", "EXPIRES", "SUMMARY"],
        lambda c: [
            c.tool_call_id,
            c.tool,
            c.conversation_id,
            when(c.proposed_at),
            when(c.expires_at),
            c.summary,
        ],
    )


async def _decide(
    agent: str, tool_call_id: str, decision: authz_pb2.ToolDecision.ValueType, reason: str, by: str
) -> None:
    request = authz_pb2.DecideRequest(
        agent_id=await client.agent_id(agent),
        tool_call_id=tool_call_id,
        decision=decision,
        reason=reason,
        decided_by=_operator(by),
    )
    reply = await call("Decide", request)
    print(f"{tool_call_id}: {DECIDE_RESULTS.get(reply.result, 'decided')}")


@command(app)
async def approve(tool_call_id: ToolCallId, agent: Agent = "default", by: By = "") -> None:
    """Approve a pending tool call: its executor then runs it, once."""
    await _decide(agent, tool_call_id, authz_pb2.TOOL_DECISION_APPROVE, "", by)


@command(app)
async def deny(
    tool_call_id: ToolCallId,
    agent: Agent = "default",
    reason: str = typer.Option("", help="why, for the conversation"),
    by: By = "",
) -> None:
    """Deny a pending tool call: it never runs."""
    await _decide(agent, tool_call_id, authz_pb2.TOOL_DECISION_DENY, reason, by)


@command(app)
async def stuck(
    agent: Agent = "default",
    older_than: float = typer.Option(300.0, metavar="SECONDS", help="claimed at least this long ago"),
    limit: Limit = 50,
    offset: Offset = 0,
    json: Json = False,
) -> None:
    """Approved calls never settled, with their claim tokens.

    Their executor claimed them and then neither succeeded nor failed (it crashed, or hangs)."""
    request = authz_pb2.ListStuckToolCallsRequest(
        agent_id=await client.agent_id(agent),
        older_than_seconds=older_than,
        page=common_pb2.PageRequest(limit=limit, offset=offset),
    )
    reply = await call("ListStuckToolCalls", request)
    common.listing(
        json,
        reply.tool_calls,
        reply.page,
        ["ID", "TOOL", "CLAIMED", "CLAIM TOKEN", "SUMMARY"],
        lambda c: [c.tool_call_id, c.tool, when(c.claim.claimed_at), c.claim.token, c.summary],
    )
    if reply.tool_calls and not json:
        print(
            "Check what each one did, stop its executor, then record the proven outcome:\n"
            "  parley approvals settle <ID> --claim-token <CLAIM TOKEN> "
            "--outcome indeterminate|success|failure"
        )


@command(app)
async def settle(
    tool_call_id: ToolCallId,
    claim_token: str = typer.Option(..., metavar="TOKEN", help="from `parley approvals stuck`"),
    outcome: Literal["failure", "indeterminate", "success"] = typer.Option(..., help="what was proven"),
    agent: Agent = "default",
    note: str = typer.Option("", help="what was found, for the record"),
    by: str = typer.Option("", metavar="WHO", help="who settled it (default: operator:<your user>)"),
) -> None:
    """Record the proven outcome of a stuck claim.

    The call never runs again; the conversation continues with the outcome."""
    request = authz_pb2.SettleRequest(
        agent_id=await client.agent_id(agent),
        tool_call_id=tool_call_id,
        claim_token=claim_token,
        outcome=authz_pb2.ToolOutcome.Value(f"TOOL_OUTCOME_{outcome.upper()}"),
        result=note,
        settled_by=_operator(by),
    )
    settled = await call("Settle", request)
    print(f"{settled.tool_call_id}: settled as {outcome}")


@command(leases, "list")
async def list_leases(
    agent: Agent = "default",
    all: bool = typer.Option(False, "--all", help="include expired leases"),
    limit: Limit = 50,
    offset: Offset = 0,
    json: Json = False,
) -> None:
    """Live leases (with --all, expired ones too)."""
    request = authz_pb2.ListLeasesRequest(
        agent_id=await client.agent_id(agent),
        include_expired=all,
        page=common_pb2.PageRequest(limit=limit, offset=offset),
    )
    reply = await call("ListLeases", request)
    common.listing(
        json,
        reply.leases,
        reply.page,
        ["RESOURCE", "LEASE", "OWNER", "SESSION", "GENERATION", "FENCING", "EXPIRES"],
        lambda lease: [
            f"{lease.resource.kind}:{lease.resource.id}",
            lease.lease_id,
            lease.owner,
            lease.session_id,
            lease.generation,
            lease.fencing_token,
            when(lease.expires_at),
        ],
    )
