"""`parley connectors add|list|revoke`: identities for connectors, kept by the pairing service.

A connector may publish only its agent's inbound messages for its own source and read only that
source's replies (parley_platform.permissions.connector); the NATS server admits it through the
pairing service while it is not revoked."""

from __future__ import annotations

import json as jsonlib
import os
from pathlib import Path
from typing import Annotated
from urllib.parse import urlsplit

import typer

from parley.v1 import pairing_pb2, pairing_pb2_grpc
from parley_platform import permissions
from parley_platform.bus import Subjects
from parley_platform.errors import InvalidArgument

from . import client, common, config
from .common import Agent, command, when

app = common.group("connectors", "Connectors: who may publish an agent's messages for a source.")
call = client.caller("pairing", pairing_pb2_grpc.PairingStub)

Name = Annotated[str, typer.Argument(metavar="NAME", help="lower-case letters, digits, '_' and '-'")]
Source = Annotated[
    str, typer.Option(metavar="SOURCE", help="the source it publishes for, e.g. telegram (web for kind web)")
]
Kind = Annotated[str, typer.Option(metavar="KIND", help="nats (a process on the bus) or web")]
Out = Annotated[Path | None, typer.Option(metavar="FILE", help="write its credentials file here (mode 0600)")]
All = Annotated[bool, typer.Option("--all", help="include revoked connectors")]
Json = Annotated[bool, typer.Option("--json", help="as JSON")]


def credentials(reply: pairing_pb2.AddConnectorResponse, nats_url: str) -> dict[str, object]:
    """What a connector needs to run: where NATS is, who it is, where it publishes and reads."""
    connector = reply.connector
    subjects = Subjects(connector.namespace)
    found: dict[str, object] = {
        "name": connector.name,
        "nats_url": nats_url,
        "user": connector.name,
        "password": reply.password,
        "agent_id": connector.agent_id,
        "source": connector.source,
        "namespace": connector.namespace,
        "inbound_subject": subjects.inbound(connector.agent_id, connector.source),
        "outbound_subject": subjects.outbound(connector.agent_id, connector.source),
        "outbound_stream": subjects.stream("OUTBOUND"),
        "durable": permissions.connector_durable(connector.name),
        "inbox_prefix": permissions.connector_inbox(connector.name),
        "stream_subject": f"{connector.namespace}.stream.{connector.agent_id}.{connector.source}",
        "cancel_subject": f"{connector.namespace}.cancel.{connector.agent_id}.{connector.source}",
    }
    if reply.api_key:
        found["api_key"] = reply.api_key
    return found


def _public_url(url: str) -> str:
    """The NATS URL without anyone's credentials in it."""
    plain = []
    for one in url.split(","):
        parts = urlsplit(one.strip())
        host = parts.hostname or ""
        plain.append(f"{parts.scheme}://{host}:{parts.port}" if parts.port else f"{parts.scheme}://{host}")
    return ",".join(plain)


@command(app)
async def add(
    name: Name, agent: Agent = "default", source: Source = "", kind: Kind = "nats", out: Out = None
) -> None:
    """Create a connector and print (or write with --out) its credentials, shown only once."""
    if not source and kind == "web":
        source = permissions.WEB_SOURCE  # the web service publishes every web connector's messages
    if not source:
        raise InvalidArgument("--source is required (the connector's source, e.g. telegram)")
    request = pairing_pb2.AddConnectorRequest(
        name=name, agent_id=await client.agent_id(agent), source=source, kind=kind
    )
    reply = await call("AddConnector", request)
    found = credentials(reply, _public_url(config.nats_url() or ""))
    if out is None:
        common.print_json(found)
        return
    fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as handle:
        jsonlib.dump(found, handle, indent=2)
    print(f"connector {name} created; its credentials are in {out}")


@command(app, "list")
async def list_connectors(agent: Agent = "", all: All = False, json: Json = False) -> None:
    """Connectors, newest first (revoked ones with --all)."""
    agent_id = await client.agent_id(agent) if agent else ""
    reply = await call(
        "ListConnectors", pairing_pb2.ListConnectorsRequest(agent_id=agent_id, include_revoked=all)
    )
    if json:
        common.print_json([common.as_dict(c) for c in reply.connectors])
        return
    common.table(
        ["NAME", "AGENT", "SOURCE", "KIND", "CREATED", "REVOKED"],
        [
            [
                c.name,
                c.agent_id,
                c.source,
                c.kind,
                when(c.created_at),
                when(c.revoked_at) if c.HasField("revoked_at") else "-",
            ]
            for c in reply.connectors
        ],
    )


@command(app)
async def revoke(name: Name) -> None:
    """Revoke a connector: it can no longer connect, and its connections are closed now."""
    reply = await call("RevokeConnector", pairing_pb2.RevokeConnectorRequest(name=name))
    print(f"revoked {reply.connector.name}; {reply.connections_closed} connection(s) closed")
