"""Autonomy as real processes: two runtime replicas, two schedulers and a model gateway whose
prompt batcher is drained by the scheduler's BATCHER_DRAIN task (no drain timer of its own).

The agent `thinker` thinks every 5 s (AUTONOMY_INTERVAL_MS) once the operator switches it on;
each think answer (a scripted rule below) runs its private THINK_NOTE action, which takes a while,
and SEND_MESSAGE to a connector's room. Both replicas receive every think result and both publish
its autonomous message: one turn runs per tick, never two at once, the evaluators run after it,
and switching off stops the ticks within an interval.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import re
import secrets
import time
import urllib.request
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from parley.v1 import common_pb2, runtime_pb2
from parley_platform.bus import Bus
from parley_platform.rpc import RpcClient
from parley_platform.testing import eventually
from support import AGENT_NAMESPACE, ROOT, SessionEnv, Suite, stream_messages

THINKER = "thinker"
THINKER_ID = str(uuid.uuid5(AGENT_NAMESPACE, f"agent:{THINKER}"))
INTERVAL_S = 5.0
WINDOW_S = 30.0
NOTE_SECONDS = 1.5  # THINK_NOTE's run: long enough that overlapping turns would show

CHARACTER = f"""
name: {THINKER}
system: You think on your own.
bio: [An agent that acts on its own time.]
plugins: ["plugins.autonomy_fixtures:autonomy_plugin"]
settings:
  AUTONOMY_INTERVAL_MS: "{int(INTERVAL_S * 1000)}"
  AUTONOMY_MODEL_SIZE: small
"""

# The think answer: the private action, and a message to a room the `e2e` connector serves.
_SID = "{sid}__"
_ANSWER = (
    f"<response><{_SID}thought>I should check on the watch room.</{_SID}thought>"
    f"<{_SID}actions>THINK_NOTE,SEND_MESSAGE</{_SID}actions><{_SID}text></{_SID}text>"
    f"<{_SID}params><SEND_MESSAGE><target>e2e:watch-room</target><text>Checking in on my own.</text>"
    f"</SEND_MESSAGE></{_SID}params></response>"
)
RULES = {"rules": [{"match": r"(?s)## Request (?P<sid>autonomy-[0-9]+-[0-9a-f]+)\n", "raw": _ANSWER}]}


@dataclass
class World:
    suite: Suite
    bus: Bus
    log: Path

    def lines(self, kind: str) -> list[list[str]]:
        text = self.log.read_text() if self.log.exists() else ""
        return [line.split() for line in text.splitlines() if line.startswith(kind + " ")]

    async def call(self, method: str, request: object, reply: type) -> object:
        return await RpcClient(self.bus).call("runtime", method, request, reply, timeout=20)  # type: ignore[arg-type]

    async def autonomous_turns(self) -> list[runtime_pb2.Turn]:
        reply = await self.call(
            "ListTurns",
            runtime_pb2.ListTurnsRequest(agent_id=THINKER_ID, page=common_pb2.PageRequest(limit=100)),
            runtime_pb2.ListTurnsResponse,
        )
        assert isinstance(reply, runtime_pb2.ListTurnsResponse)
        return [t for t in reply.turns if t.origin == "autonomous"]

    def metric(self, name: str, label: str) -> float:
        total = 0.0
        for runtime in self.suite.runtimes:
            port = runtime.env["PARLEY_RUNTIME_METRICS_PORT"]
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
                text = response.read().decode()
            pattern = rf"^{name}\{{[^}}]*{label}[^}}]*\}} ([0-9.e+]+)$"
            total += sum(float(v) for v in re.findall(pattern, text, re.M))
        return total


@pytest.fixture(scope="module")
async def world(test_env: SessionEnv, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[World]:
    root = tmp_path_factory.mktemp("autonomy")
    characters = root / "characters"
    characters.mkdir()
    (characters / "thinker.yaml").write_text(CHARACTER)
    rules = root / "rules.yaml"
    rules.write_text(json.dumps(RULES))
    log = root / "fixtures.log"
    suite = Suite(test_env, root / "logs", f"a{secrets.token_hex(4)}")
    try:
        for _ in range(2):
            await suite.add_service(
                "parley_scheduler", "SCHEDULER", PARLEY_SCHEDULER_POLL_INTERVAL_SECONDS="1"
            )
        suite.gateway = suite.gateway_process(
            PARLEY_BATCHER_SELF_DRAIN="false", PARLEY_SCRIPTED_RULES=str(rules)
        ).start()
        await suite.gateway.wait_ready()
        for _ in range(2):
            await suite.add_runtime(
                PARLEY_CHARACTERS_DIR=str(characters),
                PARLEY_TRAJECTORY_LOGGING="true",
                PYTHONPATH=str(ROOT / "tests"),
                FIXTURE_LOG=str(log),
                FIXTURE_NOTE_SECONDS=str(NOTE_SECONDS),
            )
        bus = await suite.connect()
        try:
            yield World(suite, bus, log)
        finally:
            await bus.close()
    finally:
        suite.stop()


async def test_autonomy_across_replicas_one_turn_per_tick_never_two_at_once(world: World) -> None:
    status = await world.call(
        "GetAutonomy", runtime_pb2.GetAutonomyRequest(agent_id=THINKER), runtime_pb2.AutonomyStatus
    )
    assert isinstance(status, runtime_pb2.AutonomyStatus)
    assert (status.enabled, status.decided_by, status.interval_ms, status.model_size) == (
        False,
        "character",
        5000,
        "small",
    )

    on = await world.call(
        "SetAutonomy",
        runtime_pb2.SetAutonomyRequest(agent_id=THINKER, enabled=True),
        runtime_pb2.AutonomyStatus,
    )
    assert isinstance(on, runtime_pb2.AutonomyStatus)
    assert on.enabled
    assert on.decided_by == "operator"
    started = time.time()
    await asyncio.sleep(WINDOW_S)  # the window autonomy runs in: what is measured
    off = await world.call(
        "SetAutonomy",
        runtime_pb2.SetAutonomyRequest(agent_id=THINKER, enabled=False),
        runtime_pb2.AutonomyStatus,
    )
    assert isinstance(off, runtime_pb2.AutonomyStatus)
    assert not off.enabled
    stopped = time.time()

    # Off stops it within one interval: a tick already under way may still start a turn, none after.
    await asyncio.sleep(INTERVAL_S)
    settled = len(await world.autonomous_turns())
    await asyncio.sleep(2 * INTERVAL_S)
    turns = await world.autonomous_turns()
    assert len(turns) == settled, "autonomous turns went on after autonomy was switched off"
    late = [t for t in turns if t.received_at.ToDatetime().timestamp() > stopped + INTERVAL_S]
    assert not late

    # The expected number of ticks (one right away, then one per interval), give or take one.
    during = [t for t in turns if t.received_at.ToDatetime().timestamp() <= stopped + 1]
    expected = WINDOW_S / INTERVAL_S
    assert expected - 1 <= len(during) <= expected + 1, [
        (t.received_at.ToDatetime().timestamp() - started, t.state) for t in turns
    ]
    assert all(t.state == "replied" for t in turns), [(t.state, t.reason, t.error) for t in turns]

    # Exactly one run per tick although both replicas published every tick's message.
    starts = world.lines("NOTE_START")
    ends = {line[1]: float(line[3]) for line in world.lines("NOTE_END")}
    assert sorted(line[1] for line in starts) == sorted(t.id for t in turns), (
        "one private-action run per turn"
    )
    published = world.metric("parley_autonomy_ticks_total", 'result="published"')
    assert published > len(turns), f"both replicas published ticks ({published} for {len(turns)} turns)"
    assert world.metric("parley_autonomous_turns_total", 'outcome="replied"') == len(turns)

    # Never two at once: each turn (and its private action) ends before the next one starts.
    runs = sorted((float(line[3]), ends[line[1]]) for line in starts)
    for (_, previous_end), (next_start, _) in itertools.pairwise(runs):
        assert next_start >= previous_end, runs
    spans = sorted((t.started_at.ToDatetime(), t.finished_at.ToDatetime()) for t in turns)
    for (_, previous_end), (next_start, _) in itertools.pairwise(spans):
        assert next_start >= previous_end, spans

    # The evaluators ran after every autonomous turn.
    evaluated = {line[1] for line in world.lines("EVALUATED") if line[2] == "autonomous"}
    await eventually(
        lambda: _true({t.id for t in turns} <= {line[1] for line in world.lines("EVALUATED")}),
        what="the evaluators of every autonomous turn",
    )
    assert evaluated <= {t.id for t in turns}

    # The agent reached a person: SEND_MESSAGE to a room the `e2e` connector serves.
    sent = [
        runtime_pb2.OutboundMessage.FromString(m.data)
        for m in await stream_messages(world.bus, world.bus.subjects.outbound(THINKER_ID, "e2e"))
    ]
    assert len(sent) == len(turns)
    assert {(m.channel_id, m.text) for m in sent} == {("watch-room", "Checking in on my own.")}

    # Each is a turn of the agent with its trajectory, and the status counts them.
    one = await world.call(
        "GetTurn", runtime_pb2.GetTurnRequest(agent_id=THINKER, turn_id=turns[0].id), runtime_pb2.Turn
    )
    assert isinstance(one, runtime_pb2.Turn)
    assert one.origin == "autonomous"
    assert '"think"' in one.trajectory_json
    assert "THINK_NOTE" in one.trajectory_json
    final = await world.call(
        "GetAutonomy", runtime_pb2.GetAutonomyRequest(agent_id=THINKER), runtime_pb2.AutonomyStatus
    )
    assert isinstance(final, runtime_pb2.AutonomyStatus)
    assert final.turns == len(turns)
    assert not final.enabled


async def _true(value: bool) -> bool:
    return value
