"""Fault injection at full length: the table of the README's "Outages" section.

The suite runs as real processes on a NATS and a PostgreSQL of its own (this benchmark kills
and stops them, so it never uses PARLEY_TEST_* servers), each behind a TCP proxy. A steady load
of DMs, each in its own room, runs before, during and after each fault; replies are counted from
the OUTBOUND stream. The floor is a run of the same load with no fault, in the same process:
each fault's answered ratio (answered once / published) and its drain time are set against it.

Faults: NATS SIGKILLed and restarted 2 s later; PostgreSQL restarted immediately
(``pg_ctl -m immediate``); PostgreSQL down 2 minutes (far beyond max_deliver × backoff, which
used to dead-letter the backlog); the model gateway SIGKILLed and restarted 30 s later; authz
and pairing stopped for 30 s; the proxies adding 20 ms per chunk and cutting every connection
every 2 s for 30 s.

Usage: python bench/faults.py [--rate 20] [--long-outage 120] [--service-outage 30] [--only a,b]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
from pathlib import Path

from parley_devinfra.faults import HEADER, Result, Rig, run_scenario, scenarios


async def main(args: argparse.Namespace) -> None:
    rig = Rig(
        Path(tempfile.mkdtemp(prefix="parley-faults-")),
        settings={"PARLEY_LOG_LEVEL": "WARNING", "PARLEY_MAX_DELIVER": str(args.max_deliver)},
    )
    await rig.start()
    results: list[Result] = []
    try:

        async def nothing() -> None:
            return None

        chosen = scenarios(rig, args.long_outage, args.service_outage)
        names = [n for n in args.only.split(",") if n] if args.only else list(chosen)
        unknown = set(names) - set(chosen)
        if unknown:
            raise SystemExit(f"unknown scenario(s): {', '.join(sorted(unknown))}; known: {', '.join(chosen)}")
        floor = await run_scenario(
            rig,
            "none (floor)",
            nothing,
            nothing,
            outage=0,
            rate=args.rate,
            before=args.before,
            after=args.after,
        )
        results.append(floor)
        for name in names:
            cause, recover, outage = chosen[name]
            result = await run_scenario(
                rig,
                name,
                cause,
                recover,
                outage=outage,
                rate=args.rate,
                before=args.before,
                after=args.after,
                drain_timeout=args.drain_timeout,
            )
            results.append(result)
            print(result.row(), flush=True)
    finally:
        await rig.stop()
    print("\n" + HEADER)
    for result in results:
        print(result.row())
    faults = results[1:]
    ratios = {r.fault: r.answered_once / r.published if r.published else 0.0 for r in results}
    summary = {
        "benchmark": "faults",
        "rate_per_s": args.rate,
        "max_deliver": args.max_deliver,
        "scenarios": len(faults),
        "floor_answered_ratio": ratios[floor.fault],
        "answered_ratio_min": min(ratios[r.fault] for r in faults),
        "ratio_to_floor_min": min(ratios[r.fault] for r in faults) / (ratios[floor.fault] or 1.0),
        "duplicated_total": sum(r.duplicated for r in faults),
        "dead_lettered_total": sum(r.dead_lettered for r in faults),
        "unanswered_total": sum(r.unanswered for r in faults),
        "results": [vars(r) for r in results],
    }
    print(json.dumps(summary, sort_keys=True))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=float, default=20.0, help="DMs published a second")
    parser.add_argument("--long-outage", type=float, default=120.0, help="seconds PostgreSQL stays down")
    parser.add_argument("--service-outage", type=float, default=30.0, help="seconds a service stays down")
    parser.add_argument("--before", type=float, default=10.0, help="seconds of load before each fault")
    parser.add_argument("--after", type=float, default=10.0, help="seconds of load after recovery")
    parser.add_argument("--drain-timeout", type=float, default=300.0)
    parser.add_argument("--max-deliver", type=int, default=5, help="the runtime's PARLEY_MAX_DELIVER")
    parser.add_argument("--only", default="", help="comma-separated scenarios (default: all)")
    asyncio.run(main(parser.parse_args()))
