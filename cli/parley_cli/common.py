"""What every `parley` command shares: how it is declared and run, its common options, how it prints."""

from __future__ import annotations

import asyncio
import functools
import inspect
import json
import sys
from collections.abc import Callable, Iterable, Sequence
from contextvars import ContextVar
from typing import Annotated, Any

import typer
from google.protobuf.json_format import MessageToDict
from google.protobuf.message import Message
from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text

from parley_platform.errors import ParleyError

# Set by `main.parse_args`: commands then record their parameters instead of running.
PARSED: ContextVar[dict[str, Any] | None] = ContextVar("PARSED", default=None)

Agent = Annotated[str, typer.Option(metavar="NAME", help="agent name or id")]
Json = Annotated[bool, typer.Option("--json", help="print the answer as JSON")]
Limit = Annotated[int, typer.Option(metavar="N", help="rows per page")]
Offset = Annotated[int, typer.Option(metavar="N", help="rows to skip (the `more: --offset N` line)")]
Room = Annotated[str, typer.Option(metavar="ROOM_ID", help="only this room")]


def group(name: str | None, help: str) -> typer.Typer:
    """A command group (or the root, without a name), with the same settings everywhere."""
    return typer.Typer(
        name=name,
        help=help,
        no_args_is_help=True,
        add_completion=False,
        rich_markup_mode=None,
        pretty_exceptions_enable=False,
        context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100},
    )


def command(app: typer.Typer, name: str | None = None) -> Callable[[Callable[..., Any]], Callable[..., None]]:
    """Declare a command of `app` from a function (async or not) whose docstring is its help.

    The function returns nothing or an exit code; a ParleyError it raises is printed as
    ``parley: <message>`` (and its hint) on stderr, with exit code 1.
    """

    def register(function: Callable[..., Any]) -> Callable[..., None]:
        @functools.wraps(function)
        def run(**params: Any) -> None:
            parsed = PARSED.get()
            if parsed is not None:
                parsed.update(params)
                return
            try:
                result = function(**params)
                code = asyncio.run(result) if inspect.iscoroutine(result) else result
            except ParleyError as exc:
                fail(exc)
                code = 1
            if code:
                raise typer.Exit(code)

        app.command(name)(run)
        return run

    return register


def fail(exc: ParleyError) -> None:
    print(f"parley: {exc.message}", file=sys.stderr)
    if exc.hint:
        print(f"  hint: {exc.hint}", file=sys.stderr)


def table(header: Sequence[str], rows: Iterable[Sequence[object]], more: int | None = None) -> None:
    """Rows under a header: a rich table on a terminal; otherwise plain columns two spaces apart, the
    last one unpadded, which scripts may parse. ``(none)`` when there are no rows, and where the next
    page starts when there is one."""
    cells = [[str(cell) for cell in row] for row in rows]
    if sys.stdout.isatty():
        grid = Table(*header, box=box.SIMPLE_HEAD)
        for row in cells:
            grid.add_row(*(Text(cell) for cell in row))
        Console().print(grid)
    else:
        lines = [list(header), *cells]
        widths = [max(len(line[i]) for line in lines) for i in range(len(header) - 1)]
        for line in lines:
            print(
                "  ".join([*(cell.ljust(width) for cell, width in zip(line, widths, strict=False)), line[-1]])
            )
    if not cells:
        print("(none)")
    if more is not None:
        print(f"more: --offset {more}")


def next_offset(page: Any) -> int | None:
    """Where the next page starts, from a PageResponse (None on the last page)."""
    return int(page.next_offset) if page.has_more else None


def as_dict(message: Message) -> dict[str, Any]:
    return MessageToDict(message, preserving_proto_field_name=True)


def print_json(value: Any) -> None:
    print(json.dumps(as_dict(value) if isinstance(value, Message) else value, indent=2))


def emit(json: bool, message: Message, text: str) -> None:
    """The answer: `message` as JSON with --json, else `text`."""
    if json:
        print_json(message)
    else:
        print(text)


def listing(
    json: bool,
    items: Sequence[Message],
    page: Any,
    header: Sequence[str],
    row: Callable[[Any], Sequence[object]],
    bounds: bool = False,
) -> None:
    """A page of a list: a table of ``row(item)``, or with --json its items, its limit and offset
    (with `bounds`), has_more and next_offset (null on the last page)."""
    if not json:
        table(header, [row(item) for item in items], next_offset(page))
        return
    document: dict[str, Any] = {"items": [as_dict(item) for item in items]}
    if bounds:
        document |= {"limit": page.limit, "offset": page.offset}
    next_at = page.next_offset if page.HasField("next_offset") else None
    print_json(document | {"has_more": page.has_more, "next_offset": next_at})


def when(stamp: Any) -> str:
    """A protobuf Timestamp as ``YYYY-MM-DD HH:MM:SS`` (UTC), ``-`` when unset."""
    return str(stamp.ToDatetime().strftime("%Y-%m-%d %H:%M:%S")) if stamp.seconds or stamp.nanos else "-"
