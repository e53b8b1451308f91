"""`parley actions add|list|test|remove`: custom actions, registered live over gRPC."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

from parley.v1 import actions_pb2, actions_pb2_grpc
from parley_platform.errors import InvalidArgument

from . import client

SERVICE = "runtime"  # the runtime serves CustomActions beside Runtime


async def _call(method_name: str, request: Any, timeout: float = 10.0) -> Any:
    async with client.service_stub(SERVICE, actions_pb2_grpc.CustomActionsStub) as (stub, metadata):
        return await client.call(
            getattr(stub, method_name), request, metadata, timeout=timeout, service=SERVICE
        )


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


async def cmd_add(args: argparse.Namespace) -> int:
    action = await _call(
        "AddCustomAction",
        actions_pb2.AddCustomActionRequest(agent_id=args.agent, definition=_definition(args.definition)),
    )
    state = "enabled" if action.enabled else "disabled"
    print(f"registered {action.name} ({action.id}, {action.handler_type}, {state}) for every replica")
    return 0


async def cmd_list(args: argparse.Namespace) -> int:
    reply = await _call("ListCustomActions", actions_pb2.ListCustomActionsRequest(agent_id=args.agent))
    if args.json:
        print(
            json.dumps(
                [json.loads(a.definition_json) | {"source": a.source} for a in reply.actions], indent=2
            )
        )
        return 0
    rows = [["NAME", "ID", "HANDLER", "ENABLED", "SOURCE", "DESCRIPTION"]]
    rows += [
        [a.name, a.id, a.handler_type, "yes" if a.enabled else "no", a.source, a.description]
        for a in reply.actions
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    for row in rows:
        print("  ".join([*(cell.ljust(w) for cell, w in zip(row, widths, strict=False)), row[-1]]))
    if not reply.actions:
        print("(none)")
    return 0


async def cmd_test(args: argparse.Namespace) -> int:
    request = actions_pb2.TestCustomActionRequest(agent_id=args.agent, params_json=args.params or "")
    if args.id:
        request.id = args.id
    else:
        if not args.definition:
            raise InvalidArgument("give a definition (file, - or JSON) or --id", code="DEFINITION_REQUIRED")
        request.definition = _definition(args.definition)
    reply = await _call("TestCustomAction", request, timeout=90.0)
    if args.json:
        print(json.dumps({"ok": reply.ok, "output": reply.output}))
    else:
        print(("ok: " if reply.ok else "failed: ") + reply.output)
    return 0 if reply.ok else 1


async def cmd_remove(args: argparse.Namespace) -> int:
    await _call("RemoveCustomAction", actions_pb2.RemoveCustomActionRequest(agent_id=args.agent, id=args.id))
    print(f"removed {args.id}")
    return 0


def register(subparsers: Any) -> None:
    actions = subparsers.add_parser("actions", help="custom actions (http, shell, code), registered live")
    sub = actions.add_subparsers(dest="actions_command", required=True)

    def command(
        name: str, help_text: str, handler: Callable[[argparse.Namespace], Coroutine[Any, Any, int]]
    ) -> argparse.ArgumentParser:
        p: argparse.ArgumentParser = sub.add_parser(name, help=help_text)
        p.add_argument("--agent", default="default", help="agent name or id (default: default)")
        p.set_defaults(coro=handler)
        return p

    p = command("add", "register (or replace, by id) a custom action without a restart", cmd_add)
    p.add_argument("definition", help="a JSON/YAML file, - for stdin, or the JSON itself")
    p = command("list", "the agent's custom actions from every source", cmd_list)
    p.add_argument("--json", action="store_true", help="the definitions as JSON")
    p = command("test", "run a definition once without registering it", cmd_test)
    p.add_argument("definition", nargs="?", help="a JSON/YAML file, - for stdin, or the JSON itself")
    p.add_argument("--id", help="test a registered action by id instead")
    p.add_argument("--params", help='the parameters as a JSON object, e.g. \'{"city": "Oslo"}\'')
    p.add_argument("--json", action="store_true", help="print {ok, output} as JSON")
    p = command("remove", "remove a custom action registered through the API", cmd_remove)
    p.add_argument("id", help="the action's id")
