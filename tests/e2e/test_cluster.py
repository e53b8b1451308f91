"""The suite on a three-node NATS cluster with every stream replicated three times: the leader of the
inbound stream is SIGKILLed under steady load and restarted, and every message acked by JetStream is
answered exactly once, none twice, none dead-lettered. Replies are counted from the outbound stream."""

from __future__ import annotations

import asyncio
import collections
import json
import time
from dataclasses import dataclass, field

import nats.errors
import pytest

from parley.v1 import runtime_pb2
from parley_devinfra.cluster import NatsCluster
from parley_platform.bus import Bus
from parley_platform.errors import ParleyError
from parley_platform.testing import eventually
from support import DEFAULT_AGENT_ID, SessionEnv, Suite, inbound, stream_messages

# The test's own client reconnects when its node is killed: see tests/integration/test_nats_cluster.py
# for the one nats-py warning this lets through.
pytestmark = [
    pytest.mark.e2e,
    pytest.mark.slow,
    pytest.mark.filterwarnings(
        r"ignore:Exception ignored in. <function StreamWriter.__del__:pytest.PytestUnraisableExceptionWarning"
    ),
]

RATE = 8  # messages a second, each in a room of its own
LOAD_SECONDS = 12.0  # at least: the load goes on AFTER seconds past the restart and past the recovery
AFTER = 3.0
KILL_AT = 3.0  # seconds into the load
DOWN_FOR = 2.0  # seconds before the killed node is started again


@dataclass
class Load:
    """What the publisher saw: each message acked by JetStream, and when."""

    acked: dict[str, float] = field(default_factory=dict)  # message id -> monotonic time of the ack
    longest_wait: float = 0.0  # the longest a publish waited for its ack (retries included)
    until: float = 0.0  # when the publisher stops (monotonic)
    errors: collections.Counter[str] = field(default_factory=collections.Counter)  # why publishes failed
    retries: int = 0
    killed_at: float | None = None
    resumed: float | None = None  # the first ack of a publish begun after the kill: the new leader's


async def steady_load(bus: Bus, load: Load) -> None:
    """RATE messages a second until ``load.until``; a publish that fails (no stream leader yet) is
    retried under the same dedup id until JetStream acks it."""
    index = 0
    start = time.monotonic()
    while time.monotonic() < load.until:
        message = inbound(f"cluster {index}", channel=f"cluster-{index}")
        subject = bus.subjects.inbound(message.agent_id, message.source)
        began = time.monotonic()
        while True:
            try:
                await bus.publish(
                    subject,
                    message.SerializeToString(),
                    msg_id=f"{message.source}:{message.message_id}",
                    timeout=2,
                )
                break
            except ParleyError as exc:
                load.retries += 1
                load.errors[exc.message.split(": ", 1)[-1][:80]] += 1  # without the subject
                await asyncio.sleep(0.1)
        acked = load.acked[message.message_id] = time.monotonic()
        load.longest_wait = max(load.longest_wait, acked - began)
        if load.killed_at is not None and load.resumed is None and began > load.killed_at:
            load.resumed = acked
            load.until = max(load.until, acked + AFTER)
        index += 1
        await asyncio.sleep(max(0.0, start + index / RATE - time.monotonic()))


async def leader_of(bus: Bus, stream: str, consumer: str | None = None) -> str | None:
    """The server leading ``stream`` (or its durable ``consumer``), as JetStream's info says; None
    while there is none (the request goes unanswered during an election)."""
    try:
        async with asyncio.timeout(1):
            if consumer is None:
                cluster = (await bus.js.stream_info(stream)).cluster
            else:
                cluster = (await bus.js.consumer_info(stream, consumer)).cluster
    except (TimeoutError, nats.errors.Error):
        return None
    return cluster.leader if cluster else None


async def move_leader(bus: Bus, api: str, to: str) -> None:
    """Ask the group's leader to step down in favour of ``to`` (JetStream's preferred placement)."""
    body = json.dumps({"placement": {"preferred": to}}).encode()
    answer = json.loads((await bus.nc.request(f"$JS.API.{api}", body, timeout=5)).data)
    assert answer.get("success") or "already" in json.dumps(answer), answer


async def replies_by_message(bus: Bus) -> collections.Counter[str]:
    return collections.Counter(message for message, _ in await replies_stored(bus))


async def replies_stored(bus: Bus) -> list[tuple[str, float]]:
    """(the message replied to, when the stream stored the reply, as a Unix time) for every reply."""
    msgs = await stream_messages(bus, bus.subjects.outbound(DEFAULT_AGENT_ID, "e2e"))
    return [
        (runtime_pb2.OutboundMessage.FromString(m.data).in_reply_to, m.metadata.timestamp.timestamp())
        for m in msgs
    ]


async def test_the_inbound_stream_leader_killed_under_load_loses_and_repeats_nothing(
    nats_cluster: tuple[NatsCluster, SessionEnv], tmp_path_factory: pytest.TempPathFactory
) -> None:
    cluster, env = nats_cluster
    suite = Suite(env, tmp_path_factory.mktemp("cluster-logs"), env.namespace)
    suite.common_env = {"PARLEY_STREAM_REPLICAS": "3", "PARLEY_ACK_WAIT_SECONDS": "5"}
    bus = await suite.connect()
    try:
        # The streams exist with one copy, as a deployment before PARLEY_STREAM_REPLICAS=3 left them:
        # the services scale them to three when they start.
        await bus.ensure_standard_streams(replicas=1)
        await suite.start(runtimes=1)
        streams = {
            name: await bus.js.stream_info(bus.subjects.stream(name))
            for name in ("INBOUND", "OUTBOUND", "DEAD")
        }
        assert {info.config.num_replicas for info in streams.values()} == {3}, "not scaled to R3"

        # One node leads the inbound and outbound streams and the runtime's consumer: the kill hits all.
        inbound_stream, outbound_stream = bus.subjects.stream("INBOUND"), bus.subjects.stream("OUTBOUND")

        async def consumer_on_three_nodes() -> bool:
            consumer = await bus.js.consumer_info(inbound_stream, "runtime")
            peers = consumer.cluster.replicas if consumer.cluster else None
            return bool(consumer.cluster and consumer.cluster.leader and len(peers or []) == 2)

        await eventually(
            consumer_on_three_nodes, timeout=20, what="the runtime's consumer on all three nodes"
        )
        target = await leader_of(bus, inbound_stream)
        assert target is not None
        groups = {
            f"STREAM.LEADER.STEPDOWN.{outbound_stream}": (outbound_stream, None),
            f"CONSUMER.LEADER.STEPDOWN.{inbound_stream}.runtime": (inbound_stream, "runtime"),
        }
        for api, (stream, consumer) in groups.items():
            if await leader_of(bus, stream, consumer) != target:
                await move_leader(bus, api, target)

            async def moved(stream: str = stream, consumer: str | None = consumer) -> bool:
                return await leader_of(bus, stream, consumer) == target

            await eventually(moved, timeout=20, what=f"{api} led by {target}")

        load = Load(until=time.monotonic() + LOAD_SECONDS)
        publisher = asyncio.create_task(steady_load(bus, load))
        await asyncio.sleep(KILL_AT)
        victim = cluster.node(target)
        led = [
            name
            for name, (stream, consumer) in {
                "INBOUND": (inbound_stream, None),
                "OUTBOUND": (outbound_stream, None),
                "runtime consumer": (inbound_stream, "runtime"),
            }.items()
            if await leader_of(bus, stream, consumer) == victim.name
        ]
        assert led == ["INBOUND", "OUTBOUND", "runtime consumer"], f"{victim.name} leads only {led}"
        victim.kill()
        killed_at, killed_wall = time.monotonic(), time.time()
        load.killed_at = killed_at

        async def new_leader() -> str | None:
            leader = await leader_of(bus, inbound_stream)
            return leader if leader and leader != victim.name else None

        elected = await eventually(new_leader, timeout=30, what="a new leader of the inbound stream")
        elected_after = time.monotonic() - killed_at
        await asyncio.sleep(max(0.0, killed_at + DOWN_FOR - time.monotonic()))
        await asyncio.to_thread(cluster.restart, victim)
        restarted = time.monotonic()
        load.until = max(load.until, restarted + AFTER)
        await publisher
        load_ended = time.monotonic()
        published = set(load.acked)
        before = [m for m, at in load.acked.items() if at < killed_at]
        assert len(before) >= RATE * KILL_AT * 0.5, f"only {len(before)} published before the kill"
        assert load.resumed is not None, f"no publish acked after the kill: {dict(load.errors)}"
        after = [m for m, at in load.acked.items() if at > max(restarted, load.resumed)]
        assert len(after) >= RATE * AFTER * 0.5, (
            f"only {len(after)} published after the restart and the recovery; failures: {dict(load.errors)}"
        )

        deadline = load_ended + 90
        while not published <= set(replies := await replies_by_message(bus)):
            missing = sorted(published - set(replies))
            assert time.monotonic() < deadline, (
                f"{len(missing)} of {len(published)} unanswered 90 s after the load, e.g. {missing[:3]}"
            )
            await asyncio.sleep(0.5)
        drained = time.monotonic() - load_ended
        after_kill = [m for m, at in load.acked.items() if at > killed_at]
        assert after_kill, "no message was published while the leader was down or after"

        duplicated = {m: n for m, n in replies.items() if n > 1}
        assert not duplicated, f"answered more than once: {duplicated}"
        assert set(replies) == published, "a reply to a message nobody sent"
        dead = await bus.js.stream_info(bus.subjects.stream("DEAD"))
        assert dead.state.messages == 0, "a message was dead-lettered"
        await asyncio.sleep(1)  # late duplicates (a redelivery answered again) would land now
        assert await replies_by_message(bus) == replies
        # Recovery: from the kill to the first reply to a message whose publish was acked after it.
        stored = dict(await replies_stored(bus))
        recovered = min(stored[m] for m in after_kill) - killed_wall

        print(
            json.dumps(
                {
                    "fault": "inbound stream leader SIGKILLed",
                    "killed": victim.name,
                    "led": led,
                    "new_leader": elected,
                    "published": len(published),
                    "answered_once": sum(1 for n in replies.values() if n == 1),
                    "duplicated": len(duplicated),
                    "dead_lettered": dead.state.messages,
                    "leader_elected_s": round(elected_after, 2),
                    "first_reply_to_a_message_sent_after_the_kill_s": round(recovered, 2),
                    "publishes_acked_again_after_s": round(load.resumed - killed_at, 2),
                    "longest_publish_wait_s": round(load.longest_wait, 2),
                    "publish_failures": dict(load.errors),
                    "publish_retries": load.retries,
                    "drain_after_load_s": round(drained, 2),
                }
            )
        )
    finally:
        suite.stop()
        await bus.close()
