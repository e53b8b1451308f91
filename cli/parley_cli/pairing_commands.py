"""`parley pairing list|approve|deny|allow|revoke|allowlist`: the operator side of pairing, over gRPC."""

from __future__ import annotations

import argparse
import json
import uuid
from collections.abc import Callable, Coroutine
from typing import Any

from google.protobuf.json_format import MessageToDict

from parley.v1 import pairing_pb2, pairing_pb2_grpc
from parley_platform.paging import page_bounds

from . import client

SERVICE = "pairing"


async def _agent_id(ref: str) -> str:
    """An agent UUID as given, else the id of the agent with that name (asked of the runtime)."""
    try:
        return str(uuid.UUID(ref))
    except ValueError:
        return (await client.resolve_agent(ref)).id


async def _call(method_name: str, request: Any) -> Any:
    async with client.service_stub(SERVICE, pairing_pb2_grpc.PairingStub) as (stub, metadata):
        return await client.call(getattr(stub, method_name), request, metadata, service=SERVICE)


def _when(ts: Any) -> str:
    return str(ts.ToDatetime().strftime("%Y-%m-%d %H:%M:%S")) if ts.seconds else "-"


def _print_page(reply: Any, as_json: bool, columns: Callable[[Any], list[str]], header: list[str]) -> None:
    if as_json:
        page = {
            "items": [MessageToDict(item, preserving_proto_field_name=True) for item in reply.items],
            "limit": reply.limit,
            "offset": reply.offset,
            "has_more": reply.has_more,
            "next_offset": reply.next_offset if reply.HasField("next_offset") else None,
        }
        print(json.dumps(page, indent=2))
        return
    rows = [header, *(columns(item) for item in reply.items)]
    widths = [max(len(row[i]) for row in rows) for i in range(len(header) - 1)]
    for row in rows:
        print("  ".join([*(cell.ljust(width) for cell, width in zip(row, widths, strict=False)), row[-1]]))
    if not reply.items:
        print("(none)")
    if reply.has_more:
        print(f"more: --offset {reply.next_offset}")


async def cmd_list(args: argparse.Namespace) -> int:
    limit, offset = page_bounds(args.limit, args.offset)
    reply = await _call(
        "ListPendingRequestsPage",
        pairing_pb2.ListPendingRequestsPageRequest(
            agent_id=await _agent_id(args.agent), channel=args.channel, limit=limit, offset=offset
        ),
    )
    _print_page(
        reply,
        args.json,
        lambda r: [
            r.code,
            r.sender_id,
            _when(r.created_at),
            _when(r.expires_at),
            json.dumps(dict(r.metadata)),
        ],
        ["CODE", "SENDER", "CREATED", "EXPIRES", "METADATA"],
    )
    return 0


async def cmd_allowlist(args: argparse.Namespace) -> int:
    limit, offset = page_bounds(args.limit, args.offset)
    reply = await _call(
        "GetAllowlistPage",
        pairing_pb2.GetAllowlistPageRequest(
            agent_id=await _agent_id(args.agent), channel=args.channel, limit=limit, offset=offset
        ),
    )
    _print_page(
        reply,
        args.json,
        lambda e: [e.sender_id, e.added_by, _when(e.created_at), json.dumps(dict(e.metadata))],
        ["SENDER", "ADDED BY", "ADDED", "METADATA"],
    )
    return 0


async def cmd_approve(args: argparse.Namespace) -> int:
    reply = await _call(
        "ApproveCode",
        pairing_pb2.ApproveCodeRequest(
            agent_id=await _agent_id(args.agent),
            channel=args.channel,
            code=" ".join(args.code),
            approved_by=args.by,
        ),
    )
    print(f"approved: {reply.entry.sender_id} may now talk to the agent on {reply.entry.channel}")
    return 0


async def cmd_deny(args: argparse.Namespace) -> int:
    reply = await _call(
        "DenyCode",
        pairing_pb2.DenyCodeRequest(
            agent_id=await _agent_id(args.agent), channel=args.channel, code=" ".join(args.code)
        ),
    )
    print(f"denied: the request of {reply.request.sender_id} on {reply.request.channel} is deleted")
    return 0


async def cmd_allow(args: argparse.Namespace) -> int:
    reply = await _call(
        "AddToAllowlist",
        pairing_pb2.AddToAllowlistRequest(
            agent_id=await _agent_id(args.agent),
            channel=args.channel,
            sender_id=args.sender,
            added_by=args.by,
        ),
    )
    state = "added to" if reply.created else "already on"
    print(f"{reply.entry.sender_id} is {state} the allowlist of {reply.entry.channel}")
    return 0


async def cmd_revoke(args: argparse.Namespace) -> int:
    reply = await _call(
        "RemoveFromAllowlist",
        pairing_pb2.RemoveFromAllowlistRequest(
            agent_id=await _agent_id(args.agent), channel=args.channel, sender_id=args.sender
        ),
    )
    if not reply.existed:
        print(f"{args.sender} was not on the allowlist of {args.channel}")
        return 0
    print(f"{args.sender} is removed from the allowlist of {args.channel}")
    return 0


def register(subparsers: Any) -> None:
    pairing = subparsers.add_parser("pairing", help="who may talk to an agent: pending codes and allowlists")
    sub = pairing.add_subparsers(dest="pairing_command", required=True)

    def command(
        name: str, help_text: str, handler: Callable[[argparse.Namespace], Coroutine[Any, Any, int]]
    ) -> argparse.ArgumentParser:
        p: argparse.ArgumentParser = sub.add_parser(name, help=help_text)
        p.add_argument("--agent", default="default", help="agent name or id (default: default)")
        p.add_argument("channel", help="the connector, e.g. discord")
        p.set_defaults(coro=handler)
        return p

    def paged(p: argparse.ArgumentParser) -> None:
        # Strings, checked by the same rule as the API, so `--limit 1.5` is a clear error, not argparse's.
        p.add_argument("--limit", help="1 to 100 (default 50)")
        p.add_argument("--offset", help="0 or more (default 0)")
        p.add_argument("--json", action="store_true", help="the page as JSON")

    paged(command("list", "pending pairing requests, newest first", cmd_list))
    paged(command("allowlist", "senders allowed to talk to the agent, newest first", cmd_allowlist))
    p = command("approve", "approve a pairing code: its sender joins the allowlist", cmd_approve)
    p.add_argument("code", nargs="+", help="the code, any case; spaces are ignored")
    p.add_argument("--by", default="", help="who approves (default: operator)")
    p = command("deny", "deny a pairing code: the request is deleted", cmd_deny)
    p.add_argument("code", nargs="+", help="the code, any case; spaces are ignored")
    p = command("allow", "put a sender on the allowlist", cmd_allow)
    p.add_argument("sender", help="the sender's id on the connector")
    p.add_argument("--by", default="", help="who adds them (default: operator)")
    p = command("revoke", "remove a sender from the allowlist", cmd_revoke)
    p.add_argument("sender", help="the sender's id on the connector")
