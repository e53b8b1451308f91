"""The `parley` command: run the suite, talk to its agents, and operate its services over gRPC."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from pathlib import Path
from typing import Annotated, Literal

import typer
import yaml

from parley.v1 import common_pb2, runtime_pb2
from parley_clients.character_files import inline_knowledge
from parley_connectors import Chunk, Reply
from parley_devinfra import infra
from parley_platform.errors import InvalidArgument, ParleyError

from . import (
    actions_commands,
    admin_commands,
    authz_commands,
    autonomy_commands,
    client,
    common,
    config,
    connectors_commands,
    dead_commands,
    documents_commands,
    mcp_commands,
    models_commands,
    pairing_commands,
    scheduler_commands,
    supervisor,
)
from .common import Agent, Json, Limit, Offset, Room, command

app = common.group(
    None,
    """Run the Parley suite, talk to its agents, and operate its services.

    `parley run` starts everything on this machine; the other commands talk to it. They find the
    services at PARLEY_<SERVICE>_ADDR (default 127.0.0.1 and the service's port) and NATS at
    PARLEY_NATS_URL (else what `parley infra up` recorded), and send PARLEY_OPERATOR_TOKEN
    (else the token `parley run` keeps in .parley/operator-token). Lists print plain columns when
    stdout is not a terminal, and most commands take --json. Errors go to stderr with exit code 1.
    """,
)
infra_app = common.group("infra", "The embedded NATS and PostgreSQL, under .parley/.")
app.add_typer(infra_app)
for module_app in (
    actions_commands.app,
    authz_commands.app,
    authz_commands.leases,
    autonomy_commands.app,
    connectors_commands.app,
    dead_commands.app,
    documents_commands.app,
    mcp_commands.app,
    models_commands.app,
    pairing_commands.app,
    scheduler_commands.app,
    *admin_commands.APPS,
):
    app.add_typer(module_app)

User = Annotated[
    str | None, typer.Option(metavar="NAME", help="your name as the agent sees it (default: $USER)")
]
ReplyTimeout = Annotated[
    float, typer.Option("--timeout", metavar="SECONDS", help="how long to wait for a reply")
]


@command(app)
def run() -> int:
    """Start NATS, PostgreSQL and every service here.

    The embedded NATS and PostgreSQL start unless PARLEY_NATS_URL and PARLEY_DATABASE_URL are set;
    each service logs to .parley/logs/<service>.log and is restarted when it dies. Ctrl-C stops the
    services, then the infrastructure it started."""
    return supervisor.run()


@command(infra_app)
def up() -> None:
    """Start them, and print their URLs.

    A no-op when they run already; with PARLEY_NATS_URL and PARLEY_DATABASE_URL set, those are used
    instead. Prints PARLEY_NATS_URL=... and PARLEY_DATABASE_URL=... lines."""
    env = os.environ.get
    endpoints = infra.up(
        config.state_dir(), nats_url=env("PARLEY_NATS_URL"), database_url=env("PARLEY_DATABASE_URL")
    )
    print(f"PARLEY_NATS_URL={endpoints.nats_url}")
    print(f"PARLEY_DATABASE_URL={endpoints.database_url}")


@command(infra_app)
def down() -> None:
    """Stop what `parley infra up` started."""
    stopped = infra.down(config.state_dir())
    print("stopped: " + (", ".join(stopped) if stopped else "nothing was running"))


@command(infra_app)
def status() -> None:
    """Their state as JSON: running or not, process ids, ports, URLs."""
    print(json.dumps(infra.status(config.state_dir()), indent=2, default=str))


@command(app)
async def send(
    text: str = typer.Argument(..., metavar="TEXT", help="the message"),
    agent: Agent = "default",
    user: User = None,
    timeout: ReplyTimeout = 60.0,
) -> None:
    """Send one message to an agent and print its reply.

    Exit code 1, with the reason on stderr, when no reply comes within --timeout."""
    found = await client.resolve_agent(agent)
    async with client.TerminalConnector.open(found.id, user) as connector:
        reply = await connector.reply_to(await connector.send(text), timeout)
    print(reply.text)


@command(app)
async def chat(agent: Agent = "default", user: User = None, timeout: ReplyTimeout = 60.0) -> None:
    """Chat with an agent in the terminal (Ctrl-D leaves).

    Replies come through your own durable consumer: one produced while no chat was open (a
    `parley send` that timed out, a chat left early) is shown when you come back. A reply the
    agent streams is printed as it is generated."""
    found = await client.resolve_agent(agent)
    print(f"Talking to {found.name}. Type a message and press Enter; Ctrl-D to leave.")
    async with client.TerminalConnector.open(found.id, user) as connector:
        await _show_waiting(connector, found.name)
        while True:
            try:
                text = await asyncio.to_thread(input, "you> ")
            except EOFError:
                print()
                return
            for earlier in connector.waiting():
                _show_earlier(found.name, earlier)
                await earlier.ack()
            if not text.strip():
                continue
            streamed: list[str] = []

            def on_chunk(chunk: Chunk, streamed: list[str] = streamed) -> None:
                if not streamed:
                    print(f"{found.name}> ", end="", flush=True)
                streamed.append(chunk.delta)
                print(chunk.delta, end="", flush=True)

            try:
                message_id = await connector.send(text)
                reply = await connector.reply_to(
                    message_id, timeout, on_chunk=on_chunk, on_other=lambda r: _show_earlier(found.name, r)
                )
            except ParleyError as exc:
                if streamed:
                    print()
                common.fail(exc)
                continue
            shown = "".join(streamed)
            if not streamed:
                print(f"{found.name}> {reply.text}")
            elif reply.text.startswith(shown):
                print(reply.text[len(shown) :])
            else:
                print(f"\n{found.name}> {reply.text}")


async def _show_waiting(connector: client.TerminalConnector, name: str, wait: float = 5.0) -> None:
    """Show the replies produced while no chat was open, once each (for up to ``wait`` seconds;
    any still coming are shown as they arrive)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait
    while loop.time() < deadline:
        for reply in connector.waiting():
            _show_earlier(name, reply)
            await reply.ack()
        try:
            if await connector.pending() == 0:
                return
        except ParleyError:
            return
        await asyncio.sleep(0.1)


def _show_earlier(name: str, reply: Reply) -> None:
    print(f"{name}> {reply.text}    (a reply from while you were away)")


def read_character(path: Path) -> tuple[str, list[str]]:
    """The character file's text, with its knowledge {path}/{directory} entries read and inlined
    (files next to it only): the runtime never reads a path it is sent."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise InvalidArgument(f"cannot read {path}: {exc.strerror}") from None
    try:
        document = yaml.safe_load(text)  # JSON is YAML too
    except yaml.YAMLError:
        return text, []  # the runtime says what is wrong with it
    if not isinstance(document, dict) or not isinstance(document.get("knowledge"), list):
        return text, []
    warnings = inline_knowledge(document, path.parent)
    return json.dumps(document), warnings


@command(app)
async def agents(
    action: Literal["list", "add", "enable", "disable"] = typer.Argument("list", metavar="ACTION"),
    target: str | None = typer.Argument(None, metavar="FILE|AGENT"),
    json: Json = False,
) -> None:
    """List, add, enable or disable agents.

    \b
    parley agents                  the agents (also: parley agents list)
    parley agents add FILE         create or update an agent from a character file, live
    parley agents enable AGENT     switch an agent on (AGENT: its name or id)
    parley agents disable AGENT    switch it off"""
    if action == "list":
        found = await client.list_agents()
        if json:
            common.print_json([{"id": a.id, "name": a.name, "enabled": a.enabled} for a in found])
        else:
            common.table(
                ["NAME", "ENABLED", "ID"], [[a.name, "yes" if a.enabled else "no", a.id] for a in found]
            )
        return
    if not target:
        raise typer.BadParameter(f"{action} needs " + ("a character file" if action == "add" else "an agent"))
    if action == "add":
        text, read_warnings = await asyncio.to_thread(read_character, Path(target))
        agent = await client.runtime("UpsertAgent", runtime_pb2.UpsertAgentRequest(character=text))
        print(f"saved agent {agent.name} ({agent.id}), {'enabled' if agent.enabled else 'disabled'}")
        for warning in [*read_warnings, *agent.warnings]:
            print(f"warning: {warning}", file=sys.stderr)
    else:
        request = runtime_pb2.SetAgentEnabledRequest(agent_id=target, enabled=action == "enable")
        agent = await client.runtime("SetAgentEnabled", request)
        print(f"agent {agent.name} is {'enabled' if agent.enabled else 'disabled'}")


@command(app)
async def turns(
    turn: str | None = typer.Argument(
        None, metavar="TURN_ID | cancel", help="show this turn with its trajectory, or cancel one"
    ),
    rest: list[str] | None = typer.Argument(None, metavar="[AGENT TURN_ID]", help="with cancel: the turn"),
    agent: Agent = "default",
    room: Room = "",
    limit: Limit = 50,
    offset: Offset = 0,
) -> None:
    """An agent's turns, newest first, or one with its trajectory, or cancel a running one.

    \b
    parley turns                       the turns of --agent, newest first
    parley turns TURN_ID               its state, attempts, error and trajectory (what each stage
                                       did, when PARLEY_TRAJECTORY_LOGGING records it)
    parley turns cancel AGENT TURN_ID  stop a running turn: its generation stops, it ends
                                       cancelled and sends no reply"""
    if turn == "cancel":
        if not rest or len(rest) != 2:
            raise typer.BadParameter("cancel needs AGENT and TURN_ID")
        request = runtime_pb2.CancelTurnRequest(
            agent_id=rest[0], turn_id=rest[1], reason="cancelled by the operator"
        )
        answer = await client.runtime("CancelTurn", request)
        if answer.cancelled:
            print(f"turn {answer.turn_id} cancelled")
        else:
            print(f"turn {answer.turn_id} was not running (already finished, or unknown)")
        return
    if rest:
        raise typer.BadParameter(f"unexpected arguments: {' '.join(rest)}")
    if turn:
        found = await client.runtime("GetTurn", runtime_pb2.GetTurnRequest(agent_id=agent, turn_id=turn))
        reason = f" ({found.reason})" if found.reason else ""
        print(f"turn {found.id} ({found.origin}): {found.state}{reason}, {found.attempts} attempt(s)")
        if found.error:
            print(f"error: {found.error}")
        if found.trajectory_json:
            print(json.dumps(json.loads(found.trajectory_json), indent=2))
        else:
            print("no trajectory (PARLEY_TRAJECTORY_LOGGING is off for this runtime)")
        return
    page = common_pb2.PageRequest(limit=limit, offset=offset)
    reply = await client.runtime(
        "ListTurns", runtime_pb2.ListTurnsRequest(agent_id=agent, room_id=room, page=page)
    )
    common.table(
        ["RECEIVED", "ID", "STATE", "REASON", "ORIGIN"],
        [[common.when(t.received_at), t.id, t.state, t.reason, t.origin] for t in reply.turns],
        common.next_offset(reply.page),
    )


@command(app)
async def memories(
    agent: Agent = "default",
    room: Room = "",
    table: str = typer.Option("messages", help="messages, facts, documents, fragments or reflections"),
    search: str = typer.Option(
        "", metavar="QUERY", help="search by meaning (facts unless --table says otherwise)"
    ),
    limit: Limit = 50,
    offset: Offset = 0,
) -> None:
    """What an agent remembers, or what is nearest to a query.

    Without --search: the latest memories of --table, oldest first. With --search: the nearest in
    meaning, best first, with their similarity."""
    if search:
        kind = table if table != "messages" else "facts"
        request = runtime_pb2.SearchMemoriesRequest(
            agent_id=agent, query=search, table=kind, room_id=room, limit=min(limit, 50)
        )
        hits = (await client.runtime("SearchMemories", request)).hits
        for hit in hits:
            print(f"{hit.similarity:.3f}  {hit.memory.text}")
        if not hits:
            print("(none)")
        return
    page = common_pb2.PageRequest(limit=limit, offset=offset)
    reply = await client.runtime(
        "ListMemories", runtime_pb2.ListMemoriesRequest(agent_id=agent, room_id=room, table=table, page=page)
    )
    common.table(
        ["CREATED", "ENTITY", "TEXT"],
        [[common.when(m.created_at), m.entity_id[:8], m.text] for m in reversed(reply.memories)],
        common.next_offset(reply.page),
    )


def main(argv: list[str] | None = None) -> int:
    """Run one command line; its exit code."""
    try:
        app(args=argv, prog_name="parley")
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else int(exc.code is not None)
    return 0


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The parameters a command line gives its command, without running it; SystemExit when invalid."""
    parsed: dict[str, object] = {}
    token = common.PARSED.set(parsed)
    try:
        code = main(argv)
    finally:
        common.PARSED.reset(token)
    if code:
        raise SystemExit(code)
    return argparse.Namespace(**parsed)


if __name__ == "__main__":
    sys.exit(main())
