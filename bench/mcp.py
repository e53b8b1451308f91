"""MCP tool calls against their floor, measured in the same run.

- through an action: the ``TIME_GET_CURRENT_TIME`` action the runtime builds from the tool
  (parameters as the turn hands them, the replica's long-lived session of ``McpConnection``, the
  result turned into the action's result) calling the reference server ``mcp-server-time`` over
  stdio;
- floor: the official SDK's ``ClientSession.call_tool`` on a session of its own to another
  ``mcp-server-time`` process.

Both alternate, so drift on a noisy machine hits both alike. What the ratio shows is what Parley
adds to a call (the action wrapper, its session bookkeeping); the turn around it is measured by
``bench/turn_latency.py``.

Usage: python bench/mcp.py [--calls 300]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, cast

from _common import Series, report

# This file is named like the SDK's package: the SDK is imported from site-packages, not from here.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

from mcp import ClientSession, StdioServerParameters, stdio_client  # noqa: E402

from parley_runtime.custom.ssrf import Guard  # noqa: E402
from parley_runtime.mcp.connection import McpConnection  # noqa: E402
from parley_runtime.mcp.registry import to_action  # noqa: E402
from parley_runtime.mcp_servers import McpServerDef  # noqa: E402
from parley_runtime.sdk import Content, TurnContext  # noqa: E402

SERVER = str(Path(sys.executable).parent / "mcp-server-time")
ARGS = {"timezone": "Europe/Oslo"}


async def measure(
    n: int,
    first: tuple[str, Callable[[], Awaitable[object]]],
    second: tuple[str, Callable[[], Awaitable[object]]],
) -> tuple[Series, Series]:
    for _ in range(min(10, n)):  # warm-up
        await first[1]()
        await second[1]()
    latencies: tuple[list[float], list[float]] = ([], [])
    walls = [0.0, 0.0]
    for _ in range(n):
        for index, (_, op) in enumerate((first, second)):
            t0 = time.perf_counter()
            await op()
            spent = time.perf_counter() - t0
            latencies[index].append(spent)
            walls[index] += spent
    return Series(first[0], latencies[0], walls[0]), Series(second[0], latencies[1], walls[1])


async def main(args: argparse.Namespace) -> None:
    connection = McpConnection(
        "bench",
        "time",
        McpServerDef(command=SERVER, args=["--local-timezone", "UTC"]),
        guard=Guard(),
        stdio_enabled=True,
        setting=lambda _key: None,
        redact=lambda text: text,
    )
    await connection.start()
    try:
        [tool] = [t for t in connection.tools if t.name == "get_current_time"]
        action = to_action("time", tool, connection, confirm_destructive=True)
        said: list[Content] = []

        async def callback(content: Content) -> None:
            said.append(content)

        async def through_action() -> None:
            said.clear()
            result = await action.handler(cast(TurnContext, None), dict(ARGS), callback)
            assert result is not None
            assert result.success, result.error

        params = StdioServerParameters(command=SERVER, args=["--local-timezone", "UTC"])
        with open(os.devnull, "w") as errlog:  # noqa: ASYNC230 - once, before measuring
            async with (
                stdio_client(params, errlog=errlog) as (read, write),
                ClientSession(read, write) as session,
            ):
                await session.initialize()

                async def direct() -> None:
                    result: Any = await session.call_tool("get_current_time", dict(ARGS))
                    assert not result.is_error

                row, floor = await measure(
                    args.calls,
                    ("MCP tool through the action (stdio)", through_action),
                    ("floor: SDK ClientSession.call_tool (stdio)", direct),
                )
    finally:
        await connection.stop()
    summary: dict[str, object] = {
        "benchmark": "mcp",
        "action_p50_ms": round(row.p50_ms, 3),
        "floor_p50_ms": round(floor.p50_ms, 3),
        "ratio_to_floor": round(row.p50_ms / floor.p50_ms, 2),
        "rows": {r.name: r.figures() for r in (row, floor)},
    }
    report("MCP tool calls (sequential, mcp-server-time over stdio)", [row, floor], summary)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=300)
    asyncio.run(main(parser.parse_args()))
