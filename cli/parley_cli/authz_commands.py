"""`parley approvals list|approve|deny|stuck|settle` and `parley leases list`: the operator side of
authz, over gRPC."""

from __future__ import annotations

import argparse
import getpass
import json
import uuid
from typing import Any

from google.protobuf.json_format import MessageToDict

from parley.v1 import authz_pb2, authz_pb2_grpc, common_pb2

from . import client

SERVICE = "authz"
OUTCOMES = {
    "success": authz_pb2.TOOL_OUTCOME_SUCCESS,
    "failure": authz_pb2.TOOL_OUTCOME_FAILURE,
    "indeterminate": authz_pb2.TOOL_OUTCOME_INDETERMINATE,
}
DECIDE_RESULTS = {
    authz_pb2.DECIDE_RESULT_CLAIMED: "approved: claimed for its executor, which runs it once and settles it",
    authz_pb2.DECIDE_RESULT_DENIED: "denied: it will not run",
    authz_pb2.DECIDE_RESULT_IN_FLIGHT: "already approved: its executor has not settled it yet",
    authz_pb2.DECIDE_RESULT_RECORDED: "already decided the same way",
}


async def _agent_id(ref: str) -> str:
    """An agent UUID as given, else the id of the agent with that name (asked of the runtime)."""
    try:
        return str(uuid.UUID(ref))
    except ValueError:
        return (await client.resolve_agent(ref)).id


async def _call(method_name: str, request: Any) -> Any:
    async with client.service_stub(SERVICE, authz_pb2_grpc.AuthzStub) as (stub, metadata):
        return await client.call(getattr(stub, method_name), request, metadata, service=SERVICE)


def _operator() -> str:
    try:
        return f"operator:{getpass.getuser()}"
    except (KeyError, OSError):
        return "operator"


def _when(ts: Any) -> str:
    return str(ts.ToDatetime().strftime("%Y-%m-%d %H:%M:%S")) if ts.seconds else "-"


def _table(header: list[str], rows: list[list[str]], page: common_pb2.PageResponse) -> None:
    table = [header, *rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(header) - 1)]
    for row in table:
        print("  ".join([*(cell.ljust(width) for cell, width in zip(row, widths, strict=False)), row[-1]]))
    if not rows:
        print("(none)")
    if page.has_more:
        print(f"more: --offset {page.next_offset}")


def _json(items: list[Any], page: common_pb2.PageResponse) -> None:
    print(
        json.dumps(
            {
                "items": [MessageToDict(item, preserving_proto_field_name=True) for item in items],
                "has_more": page.has_more,
                "next_offset": page.next_offset if page.HasField("next_offset") else None,
            },
            indent=2,
        )
    )


async def cmd_list(args: argparse.Namespace) -> int:
    reply = await _call(
        "ListPendingToolCalls",
        authz_pb2.ListPendingToolCallsRequest(
            agent_id=await _agent_id(args.agent),
            conversation_id=args.conversation or "",
            page=common_pb2.PageRequest(limit=args.limit, offset=args.offset),
        ),
    )
    if args.json:
        _json(list(reply.tool_calls), reply.page)
        return 0
    _table(
        ["ID", "TOOL", "CONVERSATION", "PROPOSED", "EXPIRES", "SUMMARY"],
        [
            [c.tool_call_id, c.tool, c.conversation_id, _when(c.proposed_at), _when(c.expires_at), c.summary]
            for c in reply.tool_calls
        ],
        reply.page,
    )
    return 0


async def _decide(args: argparse.Namespace, decision: authz_pb2.ToolDecision.ValueType) -> int:
    reply = await _call(
        "Decide",
        authz_pb2.DecideRequest(
            agent_id=await _agent_id(args.agent),
            tool_call_id=args.tool_call_id,
            decision=decision,
            reason=getattr(args, "reason", "") or "",
            decided_by=args.by or _operator(),
        ),
    )
    print(f"{args.tool_call_id}: {DECIDE_RESULTS.get(reply.result, 'decided')}")
    return 0


async def cmd_approve(args: argparse.Namespace) -> int:
    return await _decide(args, authz_pb2.TOOL_DECISION_APPROVE)


async def cmd_deny(args: argparse.Namespace) -> int:
    return await _decide(args, authz_pb2.TOOL_DECISION_DENY)


async def cmd_stuck(args: argparse.Namespace) -> int:
    reply = await _call(
        "ListStuckToolCalls",
        authz_pb2.ListStuckToolCallsRequest(
            agent_id=await _agent_id(args.agent),
            older_than_seconds=args.older_than,
            page=common_pb2.PageRequest(limit=args.limit, offset=args.offset),
        ),
    )
    if args.json:
        _json(list(reply.tool_calls), reply.page)
        return 0
    _table(
        ["ID", "TOOL", "CLAIMED", "CLAIM TOKEN", "SUMMARY"],
        [
            [c.tool_call_id, c.tool, _when(c.claim.claimed_at), c.claim.token, c.summary]
            for c in reply.tool_calls
        ],
        reply.page,
    )
    if reply.tool_calls:
        print(
            "Check what each one did, stop its executor, then record the proven outcome:\n"
            "  parley approvals settle <ID> --claim-token <CLAIM TOKEN> "
            "--outcome indeterminate|success|failure"
        )
    return 0


async def cmd_settle(args: argparse.Namespace) -> int:
    call = await _call(
        "Settle",
        authz_pb2.SettleRequest(
            agent_id=await _agent_id(args.agent),
            tool_call_id=args.tool_call_id,
            claim_token=args.claim_token,
            outcome=OUTCOMES[args.outcome],
            result=args.note,
            settled_by=args.by or _operator(),
        ),
    )
    print(f"{call.tool_call_id}: settled as {args.outcome}")
    return 0


async def cmd_leases(args: argparse.Namespace) -> int:
    reply = await _call(
        "ListLeases",
        authz_pb2.ListLeasesRequest(
            agent_id=await _agent_id(args.agent),
            include_expired=args.all,
            page=common_pb2.PageRequest(limit=args.limit, offset=args.offset),
        ),
    )
    if args.json:
        _json(list(reply.leases), reply.page)
        return 0
    _table(
        ["RESOURCE", "LEASE", "OWNER", "SESSION", "GENERATION", "FENCING", "EXPIRES"],
        [
            [
                f"{lease.resource.kind}:{lease.resource.id}",
                lease.lease_id,
                lease.owner,
                lease.session_id,
                str(lease.generation),
                str(lease.fencing_token),
                _when(lease.expires_at),
            ]
            for lease in reply.leases
        ],
        reply.page,
    )
    return 0


def register(subparsers: Any) -> None:
    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("--agent", default="default", help="agent name or id (default: default)")

    def paged(p: argparse.ArgumentParser) -> None:
        common(p)
        p.add_argument("--limit", type=int, default=50)
        p.add_argument("--offset", type=int, default=0)
        p.add_argument("--json", action="store_true")

    approvals = subparsers.add_parser("approvals", help="tool calls waiting for a person's decision")
    sub = approvals.add_subparsers(dest="approvals_command", required=True)

    p = sub.add_parser("list", help="pending approvals, oldest first")
    paged(p)
    p.add_argument("--conversation", help="only this conversation (room) id")
    p.set_defaults(coro=cmd_list)

    p = sub.add_parser("approve", help="approve a pending tool call; its executor then runs it once")
    common(p)
    p.add_argument("tool_call_id")
    p.add_argument("--by", help="who decided (default: operator:<your user>)")
    p.set_defaults(coro=cmd_approve)

    p = sub.add_parser("deny", help="deny a pending tool call; it never runs")
    common(p)
    p.add_argument("tool_call_id")
    p.add_argument("--reason", default="", help="why, for the conversation")
    p.add_argument("--by", help="who decided (default: operator:<your user>)")
    p.set_defaults(coro=cmd_deny)

    p = sub.add_parser(
        "stuck", help="approved calls whose executor never settled them, with their claim tokens"
    )
    paged(p)
    p.add_argument("--older-than", type=float, default=300.0, help="claimed at least this many seconds ago")
    p.set_defaults(coro=cmd_stuck)

    p = sub.add_parser("settle", help="record the proven outcome of a stuck claim (never re-runs it)")
    common(p)
    p.add_argument("tool_call_id")
    p.add_argument("--claim-token", required=True, help="from `parley approvals stuck`")
    p.add_argument("--outcome", required=True, choices=sorted(OUTCOMES))
    p.add_argument("--note", default="", help="what was found, for the record")
    p.add_argument("--by", help="who settled it (default: operator:<your user>)")
    p.set_defaults(coro=cmd_settle)

    leases = subparsers.add_parser("leases", help="interaction leases on shared resources")
    lsub = leases.add_subparsers(dest="leases_command", required=True)
    p = lsub.add_parser("list", help="live leases (with --all, expired ones too)")
    paged(p)
    p.add_argument("--all", action="store_true", help="include expired leases")
    p.set_defaults(coro=cmd_leases)
