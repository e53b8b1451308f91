"""The `parley` command."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from collections.abc import Callable, Coroutine
from pathlib import Path
from types import ModuleType
from typing import Any

from parley.v1 import common_pb2, runtime_pb2
from parley_devinfra import infra
from parley_platform.errors import ParleyError

from . import (
    actions_commands,
    authz_commands,
    client,
    config,
    documents_commands,
    models_commands,
    pairing_commands,
    scheduler_commands,
    supervisor,
)


def _fail(exc: ParleyError) -> int:
    print(f"parley: {exc.message}", file=sys.stderr)
    if exc.hint:
        print(f"  hint: {exc.hint}", file=sys.stderr)
    return 1


def _run(coro: Coroutine[Any, Any, int]) -> int:
    try:
        return asyncio.run(coro)
    except ParleyError as exc:
        return _fail(exc)
    except KeyboardInterrupt:
        return 130


def cmd_infra(args: argparse.Namespace) -> int:
    state = config.state_dir()
    try:
        if args.action == "up":
            endpoints = infra.up(
                state,
                nats_url=os.environ.get("PARLEY_NATS_URL"),
                database_url=os.environ.get("PARLEY_DATABASE_URL"),
            )
            print(f"PARLEY_NATS_URL={endpoints.nats_url}")
            print(f"PARLEY_DATABASE_URL={endpoints.database_url}")
        elif args.action == "down":
            stopped = infra.down(state)
            print("stopped: " + (", ".join(stopped) if stopped else "nothing was running"))
        else:
            print(json.dumps(infra.status(state), indent=2, default=str))
    except ParleyError as exc:
        return _fail(exc)
    return 0


async def cmd_send(args: argparse.Namespace) -> int:
    agent = await client.resolve_agent(args.agent)
    async with client.TerminalConnector.open(agent.id, args.user) as connector:
        message_id = await connector.send(args.text)
        reply = await connector.reply_to(message_id, args.timeout)
    print(reply.text)
    return 0


async def cmd_chat(args: argparse.Namespace) -> int:
    agent = await client.resolve_agent(args.agent)
    print(f"Talking to {agent.name}. Type a message and press Enter; Ctrl-D to leave.")
    async with client.TerminalConnector.open(agent.id, args.user) as connector:
        while True:
            try:
                text = await asyncio.to_thread(input, "you> ")
            except EOFError:
                print()
                return 0
            if not text.strip():
                continue
            message_id = await connector.send(text)
            try:
                reply = await connector.reply_to(message_id, args.timeout)
            except ParleyError as exc:
                _fail(exc)
                continue
            print(f"{agent.name}> {reply.text}")


async def cmd_agents(args: argparse.Namespace) -> int:
    if args.action in ("add", "enable", "disable") and not args.target:
        what = "a character file" if args.action == "add" else "an agent name or id"
        print(f"parley agents {args.action}: give {what}", file=sys.stderr)
        return 2
    if args.action == "add":
        try:
            text = await asyncio.to_thread(Path(args.target).read_text)
        except OSError as exc:
            print(f"parley: cannot read {args.target}: {exc.strerror}", file=sys.stderr)
            return 1
        async with client.runtime_stub() as (stub, metadata):
            agent = await client.call(
                stub.UpsertAgent, runtime_pb2.UpsertAgentRequest(character=text), metadata
            )
        print(f"saved agent {agent.name} ({agent.id}), {'enabled' if agent.enabled else 'disabled'}")
        return 0
    if args.action in ("enable", "disable"):
        async with client.runtime_stub() as (stub, metadata):
            agent = await client.call(
                stub.SetAgentEnabled,
                runtime_pb2.SetAgentEnabledRequest(agent_id=args.target, enabled=args.action == "enable"),
                metadata,
            )
        print(f"agent {agent.name} is {'enabled' if agent.enabled else 'disabled'}")
        return 0
    agents = await client.list_agents()
    if args.json:
        print(json.dumps([{"id": a.id, "name": a.name, "enabled": a.enabled} for a in agents], indent=2))
        return 0
    print(f"{'NAME':<20} {'ENABLED':<8} ID")
    for agent in agents:
        print(f"{agent.name:<20} {'yes' if agent.enabled else 'no':<8} {agent.id}")
    return 0


async def cmd_turns(args: argparse.Namespace) -> int:
    async with client.runtime_stub() as (stub, metadata):
        if args.turn:
            turn = await client.call(
                stub.GetTurn, runtime_pb2.GetTurnRequest(agent_id=args.agent, turn_id=args.turn), metadata
            )
            print(
                f"turn {turn.id}: {turn.state}"
                + (f" ({turn.reason})" if turn.reason else "")
                + f", {turn.attempts} attempt(s)"
            )
            if turn.error:
                print(f"error: {turn.error}")
            if turn.trajectory_json:
                print(json.dumps(json.loads(turn.trajectory_json), indent=2))
            else:
                print("no trajectory (PARLEY_TRAJECTORY_LOGGING is off for this runtime)")
            return 0
        reply = await client.call(
            stub.ListTurns,
            runtime_pb2.ListTurnsRequest(
                agent_id=args.agent,
                room_id=args.room or "",
                page=common_pb2.PageRequest(limit=args.limit, offset=args.offset),
            ),
            metadata,
        )
    for turn in reply.turns:
        when = turn.received_at.ToDatetime().strftime("%Y-%m-%d %H:%M:%S")
        print(f"{when}  {turn.id}  {turn.state:<10} {turn.reason}")
    return 0


async def cmd_rooms(args: argparse.Namespace) -> int:
    async with client.runtime_stub() as (stub, metadata):
        reply = await client.call(
            stub.ListRooms,
            runtime_pb2.ListRoomsRequest(
                agent_id=args.agent, page=common_pb2.PageRequest(limit=args.limit, offset=args.offset)
            ),
            metadata,
        )
    for room in reply.rooms:
        print(f"{room.id}  {room.source:<10} {runtime_pb2.RoomType.Name(room.type):<15} {room.channel_id}")
    return 0


async def cmd_memories(args: argparse.Namespace) -> int:
    async with client.runtime_stub() as (stub, metadata):
        if args.search:
            found = await client.call(
                stub.SearchMemories,
                runtime_pb2.SearchMemoriesRequest(
                    agent_id=args.agent,
                    query=args.search,
                    table=args.table if args.table != "messages" else "facts",
                    room_id=args.room or "",
                    limit=min(args.limit, 50),
                ),
                metadata,
            )
            for hit in found.hits:
                print(f"{hit.similarity:.3f}  {hit.memory.text}")
            return 0
        reply = await client.call(
            stub.ListMemories,
            runtime_pb2.ListMemoriesRequest(
                agent_id=args.agent,
                room_id=args.room or "",
                table=args.table,
                page=common_pb2.PageRequest(limit=args.limit, offset=args.offset),
            ),
            metadata,
        )
    for memory in reversed(reply.memories):
        when = memory.created_at.ToDatetime().strftime("%Y-%m-%d %H:%M:%S")
        print(f"{when}  {memory.entity_id[:8]}  {memory.text}")
    return 0


# Each service's operator commands live in a module of their own with a
# `register(subparsers)` function; add the module here.
COMMAND_MODULES: list[ModuleType] = [
    actions_commands,
    pairing_commands,
    authz_commands,
    scheduler_commands,
    models_commands,
    documents_commands,
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="parley", description="Run and talk to the Parley agent runtime.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("run", help="start infrastructure and every service (Ctrl-C stops all)")
    p.set_defaults(sync=lambda _args: supervisor.run())

    p = sub.add_parser("infra", help="embedded NATS and PostgreSQL")
    p.add_argument("action", choices=["up", "down", "status"])
    p.set_defaults(sync=cmd_infra)

    def talk(p: argparse.ArgumentParser) -> None:
        p.add_argument("--agent", default="default", help="agent name or id (default: default)")
        p.add_argument("--user", default=os.environ.get("USER", "you"), help="your name as the agent sees it")
        p.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for a reply")

    p = sub.add_parser("send", help="send one message and print the reply")
    talk(p)
    p.add_argument("text")
    p.set_defaults(coro=cmd_send)

    p = sub.add_parser("chat", help="chat with an agent in the terminal")
    talk(p)
    p.set_defaults(coro=cmd_chat)

    p = sub.add_parser("agents", help="list, add (create or update from a character file), enable, disable")
    p.add_argument("action", nargs="?", default="list", choices=["list", "add", "enable", "disable"])
    p.add_argument("target", nargs="?", help="character file (add) or agent name/id (enable, disable)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(coro=cmd_agents)

    def paged(p: argparse.ArgumentParser) -> None:
        p.add_argument("--agent", default="default")
        p.add_argument("--limit", type=int, default=50)
        p.add_argument("--offset", type=int, default=0)

    p = sub.add_parser("rooms", help="list an agent's rooms")
    paged(p)
    p.set_defaults(coro=cmd_rooms)

    p = sub.add_parser("memories", help="list an agent's memories, oldest first")
    paged(p)
    p.add_argument("--room", help="only this room id")
    p.add_argument("--table", default="messages")
    p.add_argument(
        "--search", metavar="QUERY", help="search by meaning (facts unless --table says otherwise)"
    )
    p.set_defaults(coro=cmd_memories)

    p = sub.add_parser("turns", help="an agent's turns, or one turn with its trajectory")
    paged(p)
    p.add_argument("turn", nargs="?", help="a turn id: show it with its trajectory")
    p.add_argument("--room", help="only this room id")
    p.set_defaults(coro=cmd_turns)

    for module in COMMAND_MODULES:
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if hasattr(args, "coro"):
        handler: Callable[[argparse.Namespace], Coroutine[Any, Any, int]] = args.coro
        return _run(handler(args))
    return int(args.sync(args))


if __name__ == "__main__":
    sys.exit(main())
