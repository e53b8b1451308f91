"""The `parley` command."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from collections.abc import Callable, Coroutine
from types import ModuleType
from typing import Any

from parley.v1 import common_pb2, runtime_pb2
from parley_platform import infra
from parley_platform.errors import ParleyError

from . import client, config, supervisor


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
    agents = await client.list_agents()
    if args.json:
        print(json.dumps([{"id": a.id, "name": a.name, "enabled": a.enabled} for a in agents], indent=2))
        return 0
    print(f"{'NAME':<20} {'ENABLED':<8} ID")
    for agent in agents:
        print(f"{agent.name:<20} {'yes' if agent.enabled else 'no':<8} {agent.id}")
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
COMMAND_MODULES: list[ModuleType] = []


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

    p = sub.add_parser("agents", help="list agents")
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
    p.set_defaults(coro=cmd_memories)

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
