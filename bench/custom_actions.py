"""Custom actions against their floors, measured in the same run.

- http: the custom http action (render, SSRF guard, pinned request, capped read) against a raw
  httpx GET of the same URL on a fresh connection (the action opens one per call: no keep-alive,
  so a pooled connection made for one host name is never reused for another);
- code: the code action (python -I -S, rlimits, audit hook, params on stdin) against spawning
  ``python -I -S -c pass``;
- shell: the shell action (exec, no shell) against spawning ``/bin/true`` with asyncio;
- the revision check (one primary-key SELECT; a turn's ingest statement now reads it, confirmation
  events still make it on its own) against ``SELECT 1``
  on the same pool.

Usage: python bench/custom_actions.py [--http 400] [--spawn 60] [--sql 2000]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
import uuid
from collections.abc import Awaitable, Callable

import httpx
from _common import ROOT, Series, bench_env, report

from parley_platform.postgres import Database, migrate
from parley_runtime.agents.custom_store import CustomActionStore
from parley_runtime.custom.definitions import parse_definition
from parley_runtime.custom.executor import CustomActionSettings, Executor
from parley_runtime.store import MIGRATIONS_DIR, SCHEMA

sys.path.insert(0, str(ROOT / "tests"))
from http_server import local_http_server


async def measure(
    n: int,
    first: tuple[str, Callable[[], Awaitable[object]]],
    second: tuple[str, Callable[[], Awaitable[object]]],
) -> tuple[Series, Series]:
    """Both operations ``n`` times, alternating, so drift on a noisy machine hits both alike."""
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


def definition(handler: dict[str, object]) -> dict[str, object]:
    return {
        "id": "bench",
        "name": "BENCH",
        "description": "bench",
        "parameters": [{"name": "q", "required": True}],
        "handler": handler,
    }


async def main(args: argparse.Namespace) -> None:
    executor = Executor(
        CustomActionSettings(allow_hosts=("127.0.0.1",), shell_enabled=True, code_enabled=True)
    )
    rows: list[Series] = []
    async with local_http_server() as server:
        server.record = False
        action = parse_definition(definition({"type": "http", "url": f"{server.base}/echo?q={{{{q}}}}"}))

        async def custom_http() -> None:
            result = await executor.run(action, {"q": "weather in Oslo"})
            assert result.ok, result.output

        async with httpx.AsyncClient(
            trust_env=False, limits=httpx.Limits(max_keepalive_connections=0)
        ) as client:

            async def raw_http() -> None:
                response = await client.get(f"{server.base}/echo?q=weather%20in%20Oslo")
                assert response.status_code == 200

            http, http_floor = await measure(
                args.http,
                ("custom http action (guard, pinned)", custom_http),
                ("floor: raw httpx GET, fresh connection", raw_http),
            )
    rows += [http, http_floor]

    code = parse_definition(definition({"type": "code", "code": "print(params['q'])"}))
    shell = parse_definition(definition({"type": "shell", "command": "echo {{q}}"}))

    async def custom_code() -> None:
        assert (await executor.run(code, {"q": "x"})).ok

    async def custom_shell() -> None:
        assert (await executor.run(shell, {"q": "x"})).ok

    async def spawn(*argv: str) -> None:
        process = await asyncio.create_subprocess_exec(*argv, stdout=asyncio.subprocess.DEVNULL)
        assert await process.wait() == 0

    code_row, code_floor = await measure(
        args.spawn,
        ("custom code action", custom_code),
        ("floor: spawn python -I -S -c pass", lambda: spawn(sys.executable, "-I", "-S", "-c", "pass")),
    )
    shell_row, shell_floor = await measure(
        args.spawn,
        ("custom shell action (exec)", custom_shell),
        ("floor: spawn /bin/true", lambda: spawn("/bin/true")),
    )
    rows += [code_row, code_floor, shell_row, shell_floor]

    with bench_env() as env:
        await migrate(env.database_url, SCHEMA, MIGRATIONS_DIR)
        db = Database(env.database_url, name="bench", min_size=1, max_size=2)
        await db.open()
        try:
            store = CustomActionStore(db)
            agent = uuid.uuid4()
            revision, sql_floor = await measure(
                args.sql,
                ("per-turn revision check", lambda: store.revision(agent)),
                ("floor: SELECT 1", lambda: db.fetchone("SELECT 1")),
            )
        finally:
            await db.close()
    rows += [revision, sql_floor]

    summary: dict[str, object] = {
        "benchmark": "custom_actions",
        "http_p50_ms": round(http.p50_ms, 3),
        "http_floor_p50_ms": round(http_floor.p50_ms, 3),
        "http_ratio_to_floor": round(http.p50_ms / http_floor.p50_ms, 2),
        "code_p50_ms": round(code_row.p50_ms, 3),
        "code_ratio_to_floor": round(code_row.p50_ms / code_floor.p50_ms, 2),
        "shell_p50_ms": round(shell_row.p50_ms, 3),
        "shell_ratio_to_floor": round(shell_row.p50_ms / shell_floor.p50_ms, 2),
        "revision_check_p50_ms": round(revision.p50_ms, 3),
        "revision_check_ratio_to_floor": round(revision.p50_ms / sql_floor.p50_ms, 2),
        "rows": {row.name: row.figures() for row in rows},
    }
    report("Custom actions (sequential, loopback)", rows, summary)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--http", type=int, default=400)
    parser.add_argument("--spawn", type=int, default=60)
    parser.add_argument("--sql", type=int, default=2000)
    asyncio.run(main(parser.parse_args()))
