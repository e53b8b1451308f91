"""`parley actions add|list|test|remove`: custom actions, registered live over gRPC."""

from __future__ import annotations

import json as jsonlib
import sys
from pathlib import Path
from typing import Annotated

import typer

from parley.v1 import actions_pb2, actions_pb2_grpc
from parley_platform.errors import InvalidArgument

from . import client, common
from .common import Agent, Json, command

app = common.group("actions", "An agent's custom actions (http, shell, code), live.")
call = client.caller("runtime", actions_pb2_grpc.CustomActionsStub)  # the runtime serves them

Definition = Annotated[
    str, typer.Argument(metavar="DEFINITION", help="a JSON/YAML file, - for stdin, or JSON")
]


def _definition(ref: str) -> str:
    """A file's text, ``-`` for stdin, or the JSON/YAML text itself."""
    if ref == "-":
        return sys.stdin.read()
    path = Path(ref)
    if ref.strip().startswith(("{", "[")) or not path.exists():
        return ref
    try:
        return path.read_text()
    except OSError as exc:
        raise InvalidArgument(
            f"cannot read {ref}: {type(exc).__name__}", code="DEFINITION_UNREADABLE"
        ) from None


@command(app)
async def add(definition: Definition, agent: Agent = "default") -> None:
    """Register a custom action (or replace it, by id), live."""
    request = actions_pb2.AddCustomActionRequest(agent_id=agent, definition=_definition(definition))
    action = await call("AddCustomAction", request)
    state = "enabled" if action.enabled else "disabled"
    print(f"registered {action.name} ({action.id}, {action.handler_type}, {state}) for every replica")


@command(app, "list")
async def list_actions(agent: Agent = "default", json: Json = False) -> None:
    """The agent's custom actions, from every source.

    Sources: the settings file, the character, and the API."""
    reply = await call("ListCustomActions", actions_pb2.ListCustomActionsRequest(agent_id=agent))
    if json:
        common.print_json([jsonlib.loads(a.definition_json) | {"source": a.source} for a in reply.actions])
        return
    common.table(
        ["NAME", "ID", "HANDLER", "ENABLED", "SOURCE", "DESCRIPTION"],
        [
            [a.name, a.id, a.handler_type, "yes" if a.enabled else "no", a.source, a.description]
            for a in reply.actions
        ],
    )


@command(app, "test")
async def try_action(
    definition: str = typer.Argument(
        "", metavar="DEFINITION", help="as for add (or give --id)", show_default=False
    ),
    id: str = typer.Option("", help="test a registered action by id instead"),
    params: str = typer.Option("", metavar="JSON", help='the parameters, e.g. \'{"city": "Oslo"}\''),
    agent: Agent = "default",
    json: bool = typer.Option(False, "--json", help="print {ok, output} as JSON"),
) -> int:
    """Run an action once without registering it.

    Exit code 1 when it fails."""
    request = actions_pb2.TestCustomActionRequest(agent_id=agent, params_json=params)
    if id:
        request.id = id
    elif definition:
        request.definition = _definition(definition)
    else:
        raise InvalidArgument("give a definition (file, - or JSON) or --id", code="DEFINITION_REQUIRED")
    reply = await call("TestCustomAction", request, timeout=90.0)
    if json:
        print(jsonlib.dumps({"ok": reply.ok, "output": reply.output}))
    else:
        print(("ok: " if reply.ok else "failed: ") + reply.output)
    return 0 if reply.ok else 1


@command(app)
async def remove(
    id: str = typer.Argument(..., metavar="ID", help="the action's id"), agent: Agent = "default"
) -> None:
    """Remove a custom action registered through the API."""
    await call("RemoveCustomAction", actions_pb2.RemoveCustomActionRequest(agent_id=agent, id=id))
    print(f"removed {id}")
