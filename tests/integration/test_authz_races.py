"""Every claim, compare-and-delete and lease raced by real clients: separate processes, each with its
own database connections, released together round after round; the winners are counted.

The full-size races (100 concurrent Decide, 64 concurrent Authorize) run over NATS against service
processes in tests/e2e/test_authz_service.py; here the statements themselves are raced with as many
direct connections as the test database can spare next to the rest of the suite.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import textwrap
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

import psycopg
import pytest
from google.protobuf.message import Message
from google.protobuf.timestamp_pb2 import Timestamp
from prometheus_client import CollectorRegistry
from racing import Span, assert_raced

from parley.v1 import authz_pb2
from parley_authz.api import AuthzApi
from parley_authz.metrics import AuthzMetrics
from parley_authz.store import MIGRATIONS_DIR, SCHEMA, AuthzStore
from parley_platform import canonical
from parley_platform.postgres import Database, migrate
from support import SessionEnv

PROCESSES = 4
CONNECTIONS = 8  # per process: 32 racing connections
CLIENTS = PROCESSES * CONNECTIONS

# A racing client process: it keeps CONNECTIONS database connections open and,
# for each "<method> <request hex>" line, calls the method once per connection,
# all at once: every call waits at a barrier, then records when it started and
# ended (time.monotonic, one clock for all processes) so the test can check that
# the calls overlapped. A Decide that wins the claim runs the "tool" (one row in
# race_execution) and settles it, like an executor. It answers with one JSON
# line of outcomes, and "ready" when it can take the next round.
CHILD = textwrap.dedent(
    """
    import asyncio, json, os, sys, time
    from prometheus_client import CollectorRegistry
    from parley.v1 import authz_pb2
    from parley_authz.api import AuthzApi
    from parley_authz.metrics import AuthzMetrics
    from parley_authz.store import AuthzStore
    from parley_platform.errors import ParleyError
    from parley_platform.postgres import Database

    REQUESTS = {
        "Decide": authz_pb2.DecideRequest,
        "Authorize": authz_pb2.AuthorizeRequest,
        "AcquireLease": authz_pb2.AcquireLeaseRequest,
        "ConsumeInteractionConfirmation": authz_pb2.ConsumeInteractionConfirmationRequest,
    }

    async def one(api, db, method, request, slot, barrier):
        if method == "AcquireLease":
            request.lease_id = f"{request.lease_id}-{os.getpid()}-{slot}"
            request.owner = f"{request.owner}-{os.getpid()}-{slot}"
        await barrier.wait()
        span = {"start": time.monotonic()}
        try:
            reply = await getattr(api, method)(request)
        except ParleyError as exc:
            return {"error": exc.code, **span, "end": time.monotonic()}
        span["end"] = time.monotonic()
        return {**span, **await settle(api, db, method, request, reply)}

    async def settle(api, db, method, request, reply):
        if method == "Decide" and reply.result == authz_pb2.DECIDE_RESULT_CLAIMED:
            await db.execute("INSERT INTO race_execution (tool_call_id) VALUES (%s)", (request.tool_call_id,))
            await api.Settle(authz_pb2.SettleRequest(
                agent_id=request.agent_id, tool_call_id=request.tool_call_id,
                claim_token=reply.tool_call.claim.token, outcome=authz_pb2.TOOL_OUTCOME_SUCCESS,
                result="ran", settled_by="race"))
            return {"ok": "claimed"}
        if method == "Decide":
            return {"ok": authz_pb2.DecideResult.Name(reply.result)}
        if method == "AcquireLease":
            lease = reply.lease
            return {"ok": "replayed" if reply.replayed else "granted", "lease_id": lease.lease_id,
                    "owner": lease.owner, "fencing_token": lease.fencing_token}
        return {"ok": method}

    async def main(url, connections):
        db = Database(url, name="authz-race", min_size=connections, max_size=connections)
        await db.open()
        api = AuthzApi(store=AuthzStore(db), bus=None, metrics=AuthzMetrics(CollectorRegistry()))
        try:
            while True:
                print("ready", flush=True)
                line = (await asyncio.to_thread(sys.stdin.readline)).strip()
                if not line:
                    return
                method, payload = line.split(" ", 1)
                template = REQUESTS[method].FromString(bytes.fromhex(payload))
                requests = [REQUESTS[method]() for _ in range(connections)]
                for request in requests:
                    request.CopyFrom(template)
                barrier = asyncio.Barrier(connections)
                results = await asyncio.gather(
                    *(one(api, db, method, r, slot, barrier) for slot, r in enumerate(requests))
                )
                print(json.dumps(results), flush=True)
        finally:
            await db.close()

    asyncio.run(main(sys.argv[1], int(sys.argv[2])))
    """
)


class Racers:
    """CLIENT processes of racing connections, released together one round at a time."""

    def __init__(self, processes: list[asyncio.subprocess.Process]) -> None:
        self.processes = processes

    @classmethod
    async def start(cls, url: str) -> Racers:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
        processes = [
            await asyncio.create_subprocess_exec(
                sys.executable,
                "-c",
                CHILD,
                url,
                str(CONNECTIONS),
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                env=env,
            )
            for _ in range(PROCESSES)
        ]
        racers = cls(processes)
        await racers._all_ready()
        return racers

    async def _line(self, process: asyncio.subprocess.Process) -> str:
        assert process.stdout is not None
        line = await asyncio.wait_for(process.stdout.readline(), 60)
        assert line, f"racer {process.pid} exited with {await process.wait()}"
        return line.decode().strip()

    async def _all_ready(self) -> None:
        for process in self.processes:
            assert await self._line(process) == "ready"

    async def race(self, method: str, request: Message) -> list[dict[str, Any]]:
        """Every connection of every process calls ``method`` once, at the same moment; the
        calls are checked to have been in flight together."""
        line = f"{method} {request.SerializeToString().hex()}\n".encode()
        for process in self.processes:
            assert process.stdin is not None
            process.stdin.write(line)
        await asyncio.gather(*(p.stdin.drain() for p in self.processes if p.stdin))
        results: list[dict[str, Any]] = []
        for process in self.processes:
            results += json.loads(await self._line(process))
        await self._all_ready()
        assert len(results) == CLIENTS, results
        assert_raced((Span(r["start"], r["end"]) for r in results), f"{method} racers")
        return results

    async def stop(self) -> None:
        for process in self.processes:
            if process.stdin is not None:
                process.stdin.close()
        for process in self.processes:
            try:
                await asyncio.wait_for(process.wait(), 15)
            except TimeoutError:
                process.kill()
                await process.wait()


@pytest.fixture(scope="module")
async def db(test_env: SessionEnv) -> AsyncIterator[Database]:
    await migrate(test_env.database_url, SCHEMA, MIGRATIONS_DIR)
    async with await psycopg.AsyncConnection.connect(test_env.database_url, autocommit=True) as conn:
        await conn.execute("CREATE TABLE IF NOT EXISTS race_execution (tool_call_id text NOT NULL)")
    database = Database(test_env.database_url, name="authz-test", min_size=1, max_size=2)
    await database.open()
    yield database
    await database.close()


@pytest.fixture(scope="module")
async def racers(db: Database) -> AsyncIterator[Racers]:
    started = await Racers.start(db.url)
    yield started
    await started.stop()


@pytest.fixture
def api(db: Database) -> AuthzApi:
    return AuthzApi(store=AuthzStore(db), bus=None, metrics=AuthzMetrics(CollectorRegistry()))


def outcomes(results: list[dict[str, Any]]) -> Counter[str]:
    return Counter(r.get("ok") or r["error"] for r in results)


async def test_100_rounds_of_concurrent_approvals_claim_and_run_once_each(
    api: AuthzApi, racers: Racers, db: Database
) -> None:
    agent = str(uuid.uuid4())
    rounds = 100
    for round_ in range(rounds):
        tool_call_id = f"race-{round_}"
        await api.PutPending(
            authz_pb2.PutPendingRequest(
                agent_id=agent,
                tool_call_id=tool_call_id,
                conversation_id="room",
                message_id=f"m-{round_}",
                tool="SEND_EMAIL",
                args_digest="0" * 64,
            )
        )
        decide = authz_pb2.DecideRequest(
            agent_id=agent,
            tool_call_id=tool_call_id,
            decision=authz_pb2.TOOL_DECISION_APPROVE,
            decided_by="racer",
        )
        counted = outcomes(await racers.race("Decide", decide))
        # The losers see the approval in flight, or already settled by the winner.
        in_flight = counted["DECIDE_RESULT_IN_FLIGHT"] + counted["DECIDE_RESULT_RECORDED"]
        assert counted["claimed"] == 1, (round_, counted)
        assert in_flight == CLIENTS - 1, (round_, counted)
    rows = await db.fetchall(
        "SELECT tool_call_id, count(*) AS n FROM race_execution WHERE tool_call_id LIKE 'race-%%' GROUP BY 1"
    )
    assert len(rows) == rounds
    assert {row["n"] for row in rows} == {1}, "a tool ran more than once"
    settled = await db.fetchone(
        "SELECT count(*) AS n FROM authz.tool_call WHERE agent_id = %s AND status = 'settled'"
        " AND outcome = 'success'",
        (uuid.UUID(agent),),
    )
    assert settled == {"n": rounds}


def ms(value: int) -> Timestamp:
    return Timestamp(seconds=value // 1000, nanos=(value % 1000) * 1_000_000)


async def test_concurrent_authorize_of_one_decision_succeeds_once(api: AuthzApi, racers: Racers) -> None:
    agent = str(uuid.uuid4())
    await api.PutAccountSnapshot(
        authz_pb2.PutAccountSnapshotRequest(agent_id=agent, account_id="acct", snapshot_version="v1")
    )
    for round_ in range(20):
        now = int(time.time() * 1000)
        request = authz_pb2.CapabilityRequest(
            version=1,
            agent_id=agent,
            account_id="acct",
            snapshot_version="v1",
            capability="payments.transfer",
            operation="create",
            catalog_risk=authz_pb2.RISK_LEVEL_R3,
            risk=authz_pb2.RISK_LEVEL_R3,
            input_digest=canonical.tool_arguments_digest({"round": round_}),
            bound_at=ms(now - 10),
        )
        confirming = round_ % 2 == 1
        decision = authz_pb2.PolicyDecision(
            version=1,
            decision_id=f"race-d-{round_}",
            request_digest=canonical.request_digest(request),
            outcome=(
                authz_pb2.POLICY_OUTCOME_CONFIRMATION_REQUIRED
                if confirming
                else authz_pb2.POLICY_OUTCOME_ALLOWED
            ),
            confirmation_id=f"race-c-{round_}" if confirming else "",
            issued_at=ms(now),
            expires_at=ms(now + 60_000),
        )
        decision.digest = canonical.decision_digest(decision)
        await api.RegisterDecision(authz_pb2.RegisterDecisionRequest(request=request, decision=decision))
        authorize = authz_pb2.AuthorizeRequest(
            request=request, decision_id=decision.decision_id, decision_digest=decision.digest
        )
        if confirming:
            grant = await api.IssueConfirmation(
                authz_pb2.IssueConfirmationRequest(
                    agent_id=agent,
                    confirmation_id=decision.confirmation_id,
                    decision_id=decision.decision_id,
                    decision_digest=decision.digest,
                    issued_by="user",
                )
            )
            authorize.grant.CopyFrom(grant.grant)
        counted = outcomes(await racers.race("Authorize", authorize))
        assert counted == {"Authorize": 1, "STALE_CAPABILITY_AUTHORIZATION": CLIENTS - 1}, (round_, counted)


async def test_concurrent_acquires_leave_one_holder_with_rising_fencing_tokens(
    api: AuthzApi, racers: Racers
) -> None:
    agent = str(uuid.uuid4())
    tokens: list[int] = []
    for round_ in range(20):
        acquire = authz_pb2.AcquireLeaseRequest(
            agent_id=agent,
            resource=authz_pb2.LeaseResource(kind="keyboard", id="main"),
            session_id="s",
            owner=f"r{round_}",
            generation=1,
            lease_id=f"lease-{round_}",
            ttl_ms=30_000,
        )
        results = await racers.race("AcquireLease", acquire)
        winners = [r for r in results if r.get("ok") == "granted"]
        assert len(winners) == 1, (round_, outcomes(results))
        assert outcomes(results)["LEASE_CONFLICT"] == CLIENTS - 1
        winner = winners[0]
        tokens.append(winner["fencing_token"])
        released = await api.ReleaseLease(
            authz_pb2.ReleaseLeaseRequest(
                agent_id=agent,
                lease_id=winner["lease_id"],
                session_id="s",
                owner=winner["owner"],
                generation=1,
            )
        )
        assert released.released
    assert tokens == sorted(tokens)
    assert len(set(tokens)) == len(tokens), "fencing tokens strictly increase"


async def test_concurrent_consumes_of_one_interaction_confirmation_succeed_once(
    api: AuthzApi, racers: Racers
) -> None:
    agent = str(uuid.uuid4())
    action = json.dumps({"kind": "click", "target": {"x": 3, "y": 4}})
    for round_ in range(20):
        confirmation_id = f"race-ic-{round_}"
        registered = await api.RegisterInteractionConfirmation(
            authz_pb2.RegisterInteractionConfirmationRequest(
                agent_id=agent, confirmation_id=confirmation_id, action_json=action
            )
        )
        issued = await api.IssueInteractionConfirmation(
            authz_pb2.IssueInteractionConfirmationRequest(
                agent_id=agent,
                confirmation_id=confirmation_id,
                action_digest=registered.confirmation.action_digest,
            )
        )
        consume = authz_pb2.ConsumeInteractionConfirmationRequest(
            agent_id=agent,
            confirmation_id=confirmation_id,
            grant_id=issued.confirmation.grant_id,
            action_json=action,
        )
        counted = outcomes(await racers.race("ConsumeInteractionConfirmation", consume))
        assert counted == {"ConsumeInteractionConfirmation": 1, "STALE_INTERACTION_CONFIRMATION": CLIENTS - 1}
