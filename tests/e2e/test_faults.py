"""Fault injection under a steady load (parley_devinfra.faults): NATS SIGKILLed and restarted,
PostgreSQL restarted immediately, PostgreSQL down for longer than max_deliver × backoff (which
used to dead-letter the backlog), the model gateway SIGKILLed and restarted later, authz and
pairing stopped, a TCP proxy in front of PostgreSQL and NATS adding latency and cutting every
connection every 2 s. Each message is answered once, none duplicated, none dead-lettered.

The durations here are short (``make test``); ``bench/faults.py`` runs the full-length versions
(PostgreSQL down 2 minutes, services down 30 s) and prints the table of the README.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from parley_devinfra.faults import HEADER, Result, Rig, dependency_up, health, run_scenario, scenarios
from parley_platform.testing import ServiceProcess, eventually

# A scenario's own budgets (3 s of load, the outage, the checks made during it, recovery, up to
# 150 s for the backlog) can add up past pytest-timeout's default 300 s on a loaded machine; the
# scenario, not the timeout, must be what reports a slow drain (with its counts and the logs).
pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(600)]

RATE = 4.0  # DMs a second: the machine is shared
# PARLEY_MAX_DELIVER=2: before the outage classification, 2 deliveries of (a 10 s pool timeout +
# backoff) dead-lettered every message held by a PostgreSQL outage of about 21 s; 30 s exceeds that.
LONG_OUTAGE = 30.0
SERVICE_OUTAGE = 8.0
RESULTS: list[Result] = []


@pytest.fixture(scope="module")
async def rig(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Rig]:
    running = Rig(tmp_path_factory.mktemp("faults"), settings={"PARLEY_MAX_DELIVER": "2"})
    try:
        yield await running.start()
    finally:
        await running.stop()
        print("\n" + HEADER)
        for result in RESULTS:
            print(result.row())


@pytest.mark.parametrize(
    "fault",
    [
        "nats_sigkill",
        "postgres_restart_immediate",
        "postgres_down_long",
        "gateway_sigkill",
        "authz_pairing_stopped",
        "proxy_latency_and_drops",
    ],
)
async def test_every_message_is_answered_once_through_the_fault(rig: Rig, fault: str) -> None:
    cause, recover, outage = scenarios(rig, LONG_OUTAGE, SERVICE_OUTAGE)[fault]
    reported: list[str] = []

    async def postgres_reported_down() -> None:
        """While PostgreSQL is down every service says so: NOT_SERVING, parley_dependency_up 0."""
        for name, process in rig.processes.items():

            async def down(process: ServiceProcess = process) -> bool:
                return dependency_up(process, "postgres") == 0.0 and await health(process) == "NOT_SERVING"

            await eventually(down, timeout=20, what=f"{name} to report PostgreSQL down")
            reported.append(name)

    during = postgres_reported_down if fault == "postgres_down_long" else None
    result = await run_scenario(
        rig, fault, cause, recover, outage=outage, rate=RATE, drain_timeout=150, during=during
    )
    RESULTS.append(result)
    logs = "\n".join(f"{name}: {p.log(15)}" for name, p in rig.processes.items())
    assert result.published >= RATE * 4, (result, logs)
    assert result.dead_lettered == 0, (result, logs)
    assert result.duplicated == 0, (result, logs)
    assert result.unanswered == 0, (result, logs)
    assert result.answered_once == result.published
    if during is not None:
        assert sorted(reported) == sorted(rig.processes)
        # Each service is SERVING again once its probe (every 2 s) gets a connection from its
        # pool, which can come after the last answer (CI saw one still NOT_SERVING, once, before
        # the pools' reconnect_timeout was cut to 10 s: test_postgres_recovery).
        for name, process in rig.processes.items():

            async def serving(process: ServiceProcess = process) -> bool:
                return await health(process) == "SERVING"

            try:
                await eventually(serving, timeout=90, what=f"{name} to report SERVING again")
            except AssertionError as exc:
                raise AssertionError(f"{exc}\n{name}: {process.log(30)}") from None
