"""The runtime's guarantees under load, across replicas, and with replicas killed mid-turn.

- Scale-out: three replicas share 2,000 messages over 50 rooms. Every message is handled once
  (one terminal turn; a replied one has one reply on the outbound stream, a superseded one none),
  replies in a room come out in message order, a superseded turn was superseded by a newer
  message of its room that had arrived before the turn finished, and replied turns of one room
  never overlap in time.
- Crash: the same kind of load while one replica at a time is SIGKILLed and replaced. Nothing is
  lost, no reply is published twice, and the non-idempotent RECORD_EFFECT of the `effects` test
  plugin (tests/plugins/effects.py) never runs twice for a message: its own log, written outside
  the runtime, has at most one row per turn, and a retried turn that finds a claim without a
  result reports UNCERTAIN_EFFECT instead of running the handler again. The first kills are aimed:
  a message that holds its effect open is sent, the test waits until the effect's row is written
  and kills the replica that wrote it, so each of those kills lands between the effect and its
  recorded result, whatever the timing of the random ones.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import os
import random
import re
import secrets
import time
import urllib.request
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest
import yaml
from effect_checks import check_effects_once, check_killed_inside_the_effect, effect_pids
from plugins.effects import DELAY_SETTING, DSN_SETTING, EFFECT_LOG_DDL, HOLD_MARKER, HOLD_SETTING
from psycopg.rows import dict_row

from parley.v1 import runtime_pb2
from parley_platform.bus import Bus
from parley_platform.testing import ServiceProcess, eventually
from support import ROOT, Suite, inbound, inbound_settled, stream_messages

AGENT_NAMESPACE = uuid.UUID("6f1f3f3e-6a0c-5b8e-9a57-5061726c6579")
TERMINAL = frozenset({"replied", "ignored", "failed", "superseded"})
TESTS = ROOT / "tests"


def agent_id(name: str) -> str:
    return str(uuid.uuid5(AGENT_NAMESPACE, f"agent:{name}"))


def turn_id(agent: str, source: str, message_id: str) -> uuid.UUID:
    """The runtime's id for the turn (and message memory) of an inbound message (parley_runtime.ids)."""
    return uuid.uuid5(uuid.UUID(agent), f"{source}:message:{message_id}")


def python_path() -> str:
    """``<repo>/tests`` first, so service processes can import ``plugins.effects``."""
    return os.pathsep.join(p for p in (str(TESTS), os.environ.get("PYTHONPATH", "")) if p)


@dataclass(frozen=True)
class Sent:
    message: runtime_pb2.InboundMessage
    turn_id: uuid.UUID


def make_load(
    agent: str,
    source: str,
    *,
    messages: int,
    rooms: int,
    seed: int,
    record_share: float = 0.0,
    record_rooms: int = 0,
) -> list[Sent]:
    """``messages`` messages spread at random over ``rooms`` DM rooms (interleaved, no runs per
    room). A ``record_share`` of them ask for RECORD_EFFECT; with ``record_rooms`` those go to the
    last ``record_rooms`` rooms only, which stay quieter, so that a retried turn often still holds
    its room and meets its own effect claim instead of being superseded."""
    rng = random.Random(seed)
    tag = secrets.token_hex(3)
    busy = rooms - record_rooms
    load = []
    for i in range(messages):
        record = rng.random() < record_share
        room = busy + rng.randrange(record_rooms) if record and record_rooms else rng.randrange(busy)
        text = f"please record {i}" if record else f"message {i} to room {room}"
        message = inbound(
            text,
            message_id=f"{tag}-{i}",
            channel=f"{tag}-room-{room}",
            source=source,
            sender=f"user{room % 7}",
            agent_id=agent,
        )
        load.append(Sent(message, turn_id(agent, source, message.message_id)))
    return load


async def publish_all(bus: Bus, load: Sequence[Sent], *, in_flight: int = 200, rate: float = 0) -> None:
    """Publish in order with up to ``in_flight`` awaiting their JetStream ack; ``rate`` > 0 paces it."""
    queue = collections.deque(load)
    started = time.monotonic()
    count = 0

    async def worker() -> None:
        nonlocal count
        while queue:
            sent = queue.popleft()
            if rate:
                count += 1
                ahead = started + count / rate - time.monotonic()
                if ahead > 0:
                    await asyncio.sleep(ahead)
            m = sent.message
            await bus.publish(
                bus.subjects.inbound(m.agent_id, m.source),
                m.SerializeToString(),
                msg_id=f"{m.source}:{m.message_id}",
            )

    await asyncio.gather(*(worker() for _ in range(in_flight)))


def turn_rows(database_url: str, agent: str, load: Iterable[Sent]) -> dict[uuid.UUID, dict[str, Any]]:
    ids = [s.turn_id for s in load]
    with psycopg.connect(database_url, row_factory=dict_row) as conn:
        rows = conn.execute(
            "SELECT t.id, t.room_id, t.stream_seq, t.state, t.reason, t.attempts, t.lease_token, t.error,"
            "       t.trajectory, t.received_at, t.started_at, t.finished_at,"
            "       r.turn_seq AS room_turn_seq, r.turn_token AS room_turn_token"
            "  FROM runtime.turn t"
            "  JOIN runtime.room r ON r.agent_id = t.agent_id AND r.id = t.room_id"
            " WHERE t.agent_id = %s AND t.id = ANY(%s::uuid[])",
            (agent, ids),
        ).fetchall()
    return {row["id"]: row for row in rows}


@dataclass
class Outbound:
    """The replies on the outbound stream, in stream order."""

    replies: list[tuple[int, runtime_pb2.OutboundMessage, str]]  # (stream seq, reply, Nats-Msg-Id)

    @classmethod
    async def read(cls, bus: Bus, agent: str, source: str) -> Outbound:
        msgs = await stream_messages(bus, bus.subjects.outbound(agent, source))
        return cls(
            [
                (
                    m.metadata.sequence.stream,
                    runtime_pb2.OutboundMessage.FromString(m.data),
                    (m.headers or {}).get("Nats-Msg-Id", ""),
                )
                for m in msgs
            ]
        )

    def by_in_reply_to(self) -> dict[str, list[tuple[int, runtime_pb2.OutboundMessage]]]:
        found: dict[str, list[tuple[int, runtime_pb2.OutboundMessage]]] = collections.defaultdict(list)
        for seq, reply, _ in self.replies:
            found[reply.in_reply_to].append((seq, reply))
        return found


def check_handled_once(
    load: Sequence[Sent], turns: dict[uuid.UUID, dict[str, Any]], outbound: Outbound, *, allowed: set[str]
) -> collections.Counter[str]:
    """Every message has one turn in a terminal state; replied ones one reply, others none;
    no reply id and no in_reply_to appears twice on the stream. Returns the states counted."""
    missing = [s.message.message_id for s in load if s.turn_id not in turns]
    assert not missing, f"{len(missing)} messages have no turn (lost), e.g. {missing[:5]}"
    states = collections.Counter(turns[s.turn_id]["state"] for s in load)
    open_turns = [
        f"{s.message.message_id} (inbound {t['stream_seq']}, {t['state']}, attempts {t['attempts']}, "
        f"lease token {t['lease_token']}; its room is now held by inbound {t['room_turn_seq']}, "
        f"token {t['room_turn_token']})"
        for s in load
        if (t := turns[s.turn_id])["state"] not in TERMINAL
    ]
    assert not open_turns, (
        f"{len(open_turns)} turns never finished (states {dict(states)}), e.g. {'; '.join(open_turns[:4])}"
    )
    assert set(states) <= allowed, f"unexpected turn states: {states}"

    ids = collections.Counter(reply.response_id for _, reply, _ in outbound.replies)
    twice = {rid: n for rid, n in ids.items() if n > 1}
    assert not twice, f"reply ids published more than once: {list(twice.items())[:5]}"
    headers = [(reply.response_id, msg_id) for _, reply, msg_id in outbound.replies]
    assert all(rid == msg_id for rid, msg_id in headers), "a reply's Nats-Msg-Id is not its response id"
    answers = outbound.by_in_reply_to()
    repeated = {m: len(r) for m, r in answers.items() if len(r) > 1}
    assert not repeated, f"messages answered more than once: {list(repeated.items())[:5]}"
    ours = {s.message.message_id for s in load}
    assert set(answers) <= ours, f"replies to unknown messages: {sorted(set(answers) - ours)[:5]}"
    for sent in load:
        state = turns[sent.turn_id]["state"]
        count = len(answers.get(sent.message.message_id, []))
        expected = 1 if state == "replied" else 0
        assert count == expected, (
            f"message {sent.message.message_id} ({state}) has {count} replies on the stream, not {expected}"
        )
    return states


def check_room_order(
    load: Sequence[Sent], turns: dict[uuid.UUID, dict[str, Any]], outbound: Outbound
) -> None:
    """Per room: replies come out in message order; a superseded turn has a newer message;
    replied turns never overlap in time. Every violation is listed, not just the first."""
    reply_seq = {m: seqs[0][0] for m, seqs in outbound.by_in_reply_to().items()}
    rooms: dict[str, list[tuple[Sent, dict[str, Any]]]] = collections.defaultdict(list)
    for sent in load:
        rooms[sent.message.channel_id].append((sent, turns[sent.turn_id]))
    problems: dict[str, list[str]] = collections.defaultdict(list)
    for room, entries in rooms.items():
        entries.sort(key=lambda e: e[1]["stream_seq"])
        for sent, turn in entries:
            # Superseded means a newer message of the room took it over: one that came later in the
            # stream and had been received (ingested) before this turn finished.
            if turn["state"] == "superseded" and not any(
                newer["stream_seq"] > turn["stream_seq"] and newer["received_at"] <= turn_end(turn)
                for _, newer in entries
            ):
                problems["superseded without a newer message received before it finished"].append(
                    f"{room}: {sent.message.message_id} (inbound {turn['stream_seq']}, finished "
                    f"{turn_end(turn).time()})"
                )
        replied = [(sent, turn) for sent, turn in entries if turn["state"] == "replied"]
        for (a, turn_a), (b, turn_b) in itertools.pairwise(replied):
            if reply_seq[a.message.message_id] > reply_seq[b.message.message_id]:
                problems["replies out of message order"].append(
                    f"{room}: {a.message.message_id} (inbound {turn_a['stream_seq']}) answered at outbound "
                    f"{reply_seq[a.message.message_id]}, after {b.message.message_id} (inbound "
                    f"{turn_b['stream_seq']}) at {reply_seq[b.message.message_id]}"
                )
        spans = sorted(
            ((turn_start(turn), turn["finished_at"], sent, turn) for sent, turn in replied),
            key=lambda span: (span[0], span[1]),
        )
        for (start_a, end_a, a, turn_a), (start_b, _, b, turn_b) in itertools.pairwise(spans):
            if end_a > start_b:
                problems["replied turns overlap"].append(
                    f"{room}: {a.message.message_id} (inbound {turn_a['stream_seq']}) ran "
                    f"{start_a.time()}–{end_a.time()}, {b.message.message_id} (inbound "
                    f"{turn_b['stream_seq']}) took the room at {start_b.time()} "
                    f"({(end_a - start_b).total_seconds() * 1000:.1f} ms before)"
                )
    assert not problems, "; ".join(
        f"{what}: {len(found)} (e.g. {' | '.join(found[:3])})" for what, found in problems.items()
    )


def turn_end(turn: dict[str, Any]) -> datetime:
    """When the turn finished. A turn superseded by the statement that first stores its message
    (a newer message already held the room) gets no ``finished_at``: it ended at ``received_at``."""
    finished: datetime | None = turn["finished_at"]
    return finished if finished is not None else turn["received_at"]


def turn_start(turn: dict[str, Any]) -> datetime:
    """When the turn took the room's lease; ``received_at`` when the runtime does not record it."""
    started: datetime | None = turn["started_at"]
    return started if started is not None else turn["received_at"]


def turns_handled(process: ServiceProcess) -> float:
    port = process.env["PARLEY_RUNTIME_METRICS_PORT"]
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    return sum(
        float(v) for v in re.findall(r'^parley_turns_total\{outcome="[a-z_]+"\} ([0-9.e+]+)$', text, re.M)
    )


def test_the_room_check_refuses_a_turn_superseded_before_any_newer_message_arrived() -> None:
    agent, at = agent_id("default"), datetime.fromisoformat("2026-12-01T12:00:00+00:00")
    older, newer = make_load(agent, "check", messages=2, rooms=1, seed=1)

    def row(seq: int, state: str, received: float, finished: float) -> dict[str, Any]:
        return {"stream_seq": seq, "state": state, "received_at": at + timedelta(seconds=received),
                "started_at": None, "finished_at": at + timedelta(seconds=finished)}  # fmt: skip

    late = {older.turn_id: row(1, "superseded", 0, 1), newer.turn_id: row(2, "ignored", 2, 3)}
    with pytest.raises(AssertionError, match="superseded without a newer message received before"):
        check_room_order([older, newer], late, Outbound([]))
    in_time = {older.turn_id: row(1, "superseded", 0, 1), newer.turn_id: row(2, "ignored", 0.5, 3)}
    check_room_order([older, newer], in_time, Outbound([]))


@pytest.mark.slow
async def test_three_replicas_handle_every_message_once_in_room_order(isolated_suite: Suite) -> None:
    suite = await isolated_suite.start(runtimes=3)
    bus = await suite.connect()
    agent, source = agent_id("default"), "scale"
    load = make_load(agent, source, messages=2000, rooms=50, seed=7)
    try:
        started = time.monotonic()
        await publish_all(bus, load)
        published = time.monotonic() - started
        await eventually(lambda: inbound_settled(bus), timeout=120, interval=0.2, what="all 2,000 handled")
        elapsed = time.monotonic() - started

        turns = turn_rows(suite.env.database_url, agent, load)
        outbound = await Outbound.read(bus, agent, source)
        states = check_handled_once(load, turns, outbound, allowed={"replied", "superseded"})
        check_room_order(load, turns, outbound)
        handled = [turns_handled(p) for p in suite.runtimes]
        assert all(n > 0 for n in handled), f"a replica handled nothing: {handled}"
        print(
            f"\nscale-out: {len(load)} messages, 50 rooms, 3 replicas: published in {published:.1f}s, "
            f"all handled in {elapsed:.1f}s ({len(load) / elapsed:.0f}/s); {dict(states)}; "
            f"per replica {handled}; started_at recorded: "
            f"{sum(t['started_at'] is not None for t in turns.values())}/{len(turns)}"
        )
    finally:
        await bus.close()


def effects_characters(directory: Path, dsn: str, delay_ms: int) -> Path:
    """tests/characters/effects.yaml, in ``directory``, with the effect log's DSN (a secret: it may
    hold a password) and how long the effect takes."""
    character = yaml.safe_load((TESTS / "characters" / "effects.yaml").read_text())
    character["secrets"] = {**character.get("secrets", {}), DSN_SETTING: dsn}
    # A held effect waits for its kill; a minute is far longer than the test takes to aim it.
    character["settings"] = {**character.get("settings", {}), DELAY_SETTING: delay_ms, HOLD_SETTING: 60}
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "effects.yaml").write_text(yaml.safe_dump(character))
    return directory


@pytest.mark.slow
async def test_replicas_killed_under_load_lose_nothing_and_repeat_no_effect(
    isolated_suite: Suite, tmp_path: Path
) -> None:
    database_url = isolated_suite.env.database_url
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(EFFECT_LOG_DDL)
    runtime_env = {
        "PARLEY_CHARACTERS_DIR": str(effects_characters(tmp_path / "characters", database_url, 200)),
        "PYTHONPATH": python_path(),
        "PARLEY_ACK_WAIT_SECONDS": "2",
        "PARLEY_TRAJECTORY_LOGGING": "true",
    }
    # A model that takes 250 ms keeps turns in flight long enough for the kills to hit some.
    suite = isolated_suite
    suite.gateway = suite.gateway_process(PARLEY_SCRIPTED_LATENCY_MS="250").start()
    await suite.gateway.wait_ready()
    for _ in range(3):
        await suite.add_runtime(**runtime_env)
    bus = await suite.connect()
    agent, source = agent_id("effects"), "crash"
    load = make_load(agent, source, messages=1000, rooms=40, seed=11, record_share=0.2, record_rooms=20)
    held = held_effects(agent, source, count=3)
    alive = list(suite.runtimes)
    rng = random.Random(3)
    kills = 0
    killed_inside: dict[uuid.UUID, int] = {}  # held turn → pid of the replica killed inside its effect
    try:
        started = time.monotonic()
        # ~18 s of load; one replica at a time is SIGKILLed and a replacement started at once, for
        # as long as the load lasts (at least 6 times). The first kills are aimed inside an effect.
        publisher = asyncio.ensure_future(publish_all(bus, load, in_flight=32, rate=55))
        for sent in held:
            await publish_all(bus, [sent], in_flight=1)
            [pid] = await eventually(
                lambda sent=sent: effect_pids(database_url, sent.turn_id),
                timeout=60,
                what=f"the held effect of {sent.message.message_id} to be written",
            )
            victim = next(p for p in alive if p.pid == pid)
            alive.remove(victim)
            victim.kill()
            kills += 1
            killed_inside[sent.turn_id] = pid
            replacement = suite.runtime_process(**runtime_env).start()
            suite.runtimes.append(replacement)
            alive.append(replacement)
            await replacement.wait_ready()
        while not publisher.done() or kills < 6:
            await asyncio.sleep(rng.uniform(2, 3))
            await alive[-1].wait_ready()  # the previous replacement, before it can be a victim
            victim = alive.pop(rng.randrange(len(alive)))
            victim.kill()
            kills += 1
            replacement = suite.runtime_process(**runtime_env).start()
            suite.runtimes.append(replacement)
            alive.append(replacement)
        await alive[-1].wait_ready()
        await publisher
        await eventually(lambda: inbound_settled(bus), timeout=90, interval=0.2, what="all 1,000 handled")
        elapsed = time.monotonic() - started

        everything = [*load, *held]
        turns = turn_rows(database_url, agent, everything)
        outbound = await Outbound.read(bus, agent, source)
        states = check_handled_once(everything, turns, outbound, allowed={"replied", "superseded"})
        record = [s for s in everything if s.message.text.startswith("please record")]
        effects = check_effects_once(database_url, agent, record, turns)
        check_killed_inside_the_effect(database_url, agent, held, turns, killed_inside)
        retried = sum(turns[s.turn_id]["attempts"] > 1 for s in load)
        assert retried > 0, "no turn was retried: the kills hit nothing"
        spans = sorted(
            (t["finished_at"] - turn_start(t)).total_seconds()
            for t in turns.values()
            if t["state"] == "replied"
        )
        print(
            f"\ncrash: {len(load)} messages, 40 rooms, {kills} replicas killed, settled in {elapsed:.1f}s; "
            f"{dict(states)}; replied turns took {spans[len(spans) // 2] * 1000:.0f} ms (median); "
            f"{retried} turns retried; {len(killed_inside)} kills aimed inside an effect; effects: {effects}"
        )
    finally:
        await bus.close()


def held_effects(agent: str, source: str, *, count: int) -> list[Sent]:
    """Messages whose RECORD_EFFECT holds after the effect, each in a room of its own (so that the
    redelivery after the kill holds the room and meets the effect's claim, never superseded)."""
    tag = secrets.token_hex(3)
    held = []
    for i in range(count):
        message = inbound(
            f"please record {HOLD_MARKER} {i}",
            message_id=f"{tag}-held-{i}",
            channel=f"{tag}-held-room-{i}",
            source=source,
            sender="holder",
            agent_id=agent,
        )
        held.append(Sent(message, turn_id(agent, source, message.message_id)))
    return held
