"""`parley pairing list|approve|deny|allow|revoke|allowlist`: the operator side of pairing, over gRPC."""

from __future__ import annotations

import json as jsonlib
from typing import Annotated, Any

import typer

from parley.v1 import pairing_pb2, pairing_pb2_grpc
from parley_platform.paging import page_bounds

from . import client, common
from .common import Agent, command, when

app = common.group("pairing", "Who may talk to an agent: pairing codes and allowlists.")
call = client.caller("pairing", pairing_pb2_grpc.PairingStub)

Channel = Annotated[str, typer.Argument(metavar="CHANNEL", help="the connector, e.g. discord")]
Code = Annotated[list[str], typer.Argument(metavar="CODE", help="the code, any case; spaces are ignored")]
Sender = Annotated[str, typer.Argument(metavar="SENDER", help="the sender's id on the connector")]
By = Annotated[str, typer.Option(metavar="WHO", help="who approves (default: operator)")]
# Strings, checked by the same rule as the API, so `--limit 1.5` is a clear error like the API's.
Limit = Annotated[str | None, typer.Option(metavar="N", help="1 to 100 (default 50)")]
Offset = Annotated[str | None, typer.Option(metavar="N", help="0 or more (default 0)")]
Json = Annotated[bool, typer.Option("--json", help="the page as JSON")]


def _metadata(item: Any) -> str:
    return jsonlib.dumps(dict(item.metadata))


@command(app, "list")
async def list_requests(
    channel: Channel, agent: Agent = "default", limit: Limit = None, offset: Offset = None, json: Json = False
) -> None:
    """Pending pairing requests, newest first."""
    limit_, offset_ = page_bounds(limit, offset)
    request = pairing_pb2.ListPendingRequestsPageRequest(
        agent_id=await client.agent_id(agent), channel=channel, limit=limit_, offset=offset_
    )
    reply = await call("ListPendingRequestsPage", request)
    common.listing(
        json,
        reply.items,
        reply,
        ["CODE", "SENDER", "CREATED", "EXPIRES", "METADATA"],
        lambda r: [r.code, r.sender_id, when(r.created_at), when(r.expires_at), _metadata(r)],
        bounds=True,
    )


@command(app)
async def allowlist(
    channel: Channel, agent: Agent = "default", limit: Limit = None, offset: Offset = None, json: Json = False
) -> None:
    """Senders allowed to talk to the agent, newest first."""
    limit_, offset_ = page_bounds(limit, offset)
    request = pairing_pb2.GetAllowlistPageRequest(
        agent_id=await client.agent_id(agent), channel=channel, limit=limit_, offset=offset_
    )
    reply = await call("GetAllowlistPage", request)
    common.listing(
        json,
        reply.items,
        reply,
        ["SENDER", "ADDED BY", "ADDED", "METADATA"],
        lambda e: [e.sender_id, e.added_by, when(e.created_at), _metadata(e)],
        bounds=True,
    )


@command(app)
async def approve(channel: Channel, code: Code, agent: Agent = "default", by: By = "") -> None:
    """Approve a pairing code: its sender joins the allowlist."""
    request = pairing_pb2.ApproveCodeRequest(
        agent_id=await client.agent_id(agent), channel=channel, code=" ".join(code), approved_by=by
    )
    reply = await call("ApproveCode", request)
    print(f"approved: {reply.entry.sender_id} may now talk to the agent on {reply.entry.channel}")


@command(app)
async def deny(channel: Channel, code: Code, agent: Agent = "default") -> None:
    """Deny a pairing code: the request is deleted."""
    request = pairing_pb2.DenyCodeRequest(
        agent_id=await client.agent_id(agent), channel=channel, code=" ".join(code)
    )
    reply = await call("DenyCode", request)
    print(f"denied: the request of {reply.request.sender_id} on {reply.request.channel} is deleted")


@command(app)
async def allow(
    channel: Channel,
    sender: Sender,
    agent: Agent = "default",
    by: str = typer.Option("", metavar="WHO", help="who adds them (default: operator)"),
) -> None:
    """Put a sender on the allowlist."""
    request = pairing_pb2.AddToAllowlistRequest(
        agent_id=await client.agent_id(agent), channel=channel, sender_id=sender, added_by=by
    )
    reply = await call("AddToAllowlist", request)
    state = "added to" if reply.created else "already on"
    print(f"{reply.entry.sender_id} is {state} the allowlist of {reply.entry.channel}")


@command(app)
async def revoke(channel: Channel, sender: Sender, agent: Agent = "default") -> None:
    """Remove a sender from the allowlist."""
    request = pairing_pb2.RemoveFromAllowlistRequest(
        agent_id=await client.agent_id(agent), channel=channel, sender_id=sender
    )
    reply = await call("RemoveFromAllowlist", request)
    state = "is removed from" if reply.existed else "was not on"
    print(f"{sender} {state} the allowlist of {channel}")
