"""`parley dead list|show|replay|purge`: the dead letters, over the runtime's operator gRPC API."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated

import typer

from parley.v1 import dead_pb2, dead_pb2_grpc
from parley_platform.errors import InvalidArgument

from . import client, common
from .common import command, when

app = common.group(
    "dead", "Dead letters: messages a consumer gave up on, with the reason; replay or purge them."
)
call = client.caller("runtime", dead_pb2_grpc.DeadLettersStub)

Stream = Annotated[str, typer.Option(metavar="STREAM", help="the original stream, e.g. INBOUND or EVENTS")]
Reason = Annotated[str, typer.Option(metavar="TEXT", help="the reason contains this (any case)")]
AgentRef = Annotated[str, typer.Option("--agent", metavar="AGENT", help="the agent's name or id")]
Since = Annotated[
    str, typer.Option(metavar="TIME", help="dead-lettered at or after (ISO 8601, UTC unless given)")
]
Until = Annotated[str, typer.Option(metavar="TIME", help="dead-lettered at or before (ISO 8601)")]
Json = Annotated[bool, typer.Option("--json", help="as JSON")]
Sequences = Annotated[
    list[int] | None, typer.Argument(metavar="[SEQUENCE]...", help="dead letters by sequence (from `list`)")
]


def _time(value: str, option: str) -> datetime | None:
    if not value:
        return None
    try:
        parsed = datetime.fromisoformat(value)
    except ValueError as exc:
        raise InvalidArgument(
            f"{option} must be an ISO 8601 time like 2026-01-31T12:00, got {value!r}"
        ) from exc
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)


def _filter(
    sequences: list[int] | None, stream: str, reason: str, agent: str, since: str, until: str
) -> dead_pb2.DeadLetterFilter:
    chosen = dead_pb2.DeadLetterFilter(stream=stream, reason=reason, agent=agent, sequences=sequences or [])
    for field, value, option in (("since", since, "--since"), ("until", until, "--until")):
        stamp = _time(value, option)
        if stamp is not None:
            getattr(chosen, field).FromDatetime(stamp)
    return chosen


@command(app, "list")
async def list_dead(
    stream: Stream = "",
    reason: Reason = "",
    agent: AgentRef = "",
    since: Since = "",
    until: Until = "",
    limit: Annotated[int, typer.Option(metavar="N", help="1 to 100 (default 50)")] = 50,
    after: Annotated[int, typer.Option(metavar="SEQUENCE", help="start after this sequence")] = 0,
    json: Json = False,
) -> None:
    """Dead letters, oldest first."""
    reply = await call(
        "ListDeadLetters",
        dead_pb2.ListDeadLettersRequest(
            filter=_filter(None, stream, reason, agent, since, until), limit=limit, after=after
        ),
    )
    if json:
        common.print_json(reply)
        return
    common.table(
        ["SEQ", "DEAD AT", "STREAM", "AGENT", "DELIVERIES", "REASON"],
        [
            [d.sequence, when(d.dead_at), d.stream, d.agent_id or "-", d.deliveries, d.reason[:120]]
            for d in reply.dead_letters
        ],
    )
    if reply.next_after:
        print(f"more: --after {reply.next_after}")


@command(app)
async def show(sequence: Annotated[int, typer.Argument(metavar="SEQUENCE")], json: Json = False) -> None:
    """One dead letter: where it came from, why, and its bytes (as text when they are text)."""
    letter = await call("GetDeadLetter", dead_pb2.GetDeadLetterRequest(sequence=sequence))
    if json:
        common.print_json(letter)
        return
    for label, value in (
        ("sequence", letter.sequence),
        ("dead at", when(letter.dead_at)),
        ("stream", letter.stream),
        ("subject", letter.subject),
        ("original sequence", letter.original_sequence),
        ("consumer", letter.consumer or "-"),
        ("msg id", letter.msg_id or "-"),
        ("agent", letter.agent_id or "-"),
        ("deliveries", letter.deliveries),
        ("reason", letter.reason),
        ("size", f"{letter.size} bytes"),
    ):
        print(f"{label}: {value}")
    print(f"data: {letter.data!r}"[:2000])


@command(app)
async def replay(
    sequences: Sequences = None,
    stream: Stream = "",
    reason: Reason = "",
    agent: AgentRef = "",
    since: Since = "",
    until: Until = "",
    wait: Annotated[float, typer.Option(metavar="SECONDS", help="wait for each copy to be handled")] = 30.0,
    json: Json = False,
) -> int:
    """Publish dead letters again to their original subject, under their original dedup identity;
    each is removed once its copy is handled (kept while pending, and safe to replay again)."""
    chosen = _filter(sequences, stream, reason, agent, since, until)
    reply = await call(
        "ReplayDeadLetters",
        dead_pb2.ReplayDeadLettersRequest(filter=chosen, wait_seconds=wait),
        timeout=wait * 2 + 30,
    )
    if json:
        common.print_json(reply)
    else:
        common.table(
            ["SEQ", "OUTCOME", "COPY", "MSG ID"],
            [[r.sequence, r.outcome, r.replay_sequence, r.msg_id] for r in reply.replayed],
        )
    return 0 if all(r.outcome == "handled" for r in reply.replayed) else 3


@command(app)
async def purge(
    sequences: Sequences = None,
    stream: Stream = "",
    reason: Reason = "",
    agent: AgentRef = "",
    since: Since = "",
    until: Until = "",
    all: Annotated[bool, typer.Option("--all", help="every dead letter (needed without a filter)")] = False,
) -> None:
    """Remove dead letters for good."""
    chosen = _filter(sequences, stream, reason, agent, since, until)
    reply = await call("PurgeDeadLetters", dead_pb2.PurgeDeadLettersRequest(filter=chosen, all=all))
    print(f"purged: {reply.purged}")
