"""Replies in a room reach the outbound stream in message order, whichever replica saved them
and however late it publishes (queries.sql `save_replies` and `ingest`, ``Outbox.publish_turn``).

The turn that saves a reply publishes it right after the commit, and the room's next message
takes the room only after that commit; but the publish can still come late (the saves of
concurrent turns commit as one group, the process is busy, or it dies before publishing). So the
save also keeps the replies on the room's row, the next message's ingest reads them back, and
that turn puts them on the stream before its own unless its process knows they are there.
Against a real PostgreSQL and a real JetStream."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest

from parley.v1 import runtime_pb2
from parley_platform.bus import Bus
from parley_runtime.records import Ingested, NewMessage
from parley_runtime.store import RuntimeStore
from parley_runtime.turn.ports import Outbox
from parley_runtime.turn.reply import Reply
from support import SessionEnv, new_agent, new_message, runtime_store, stream_messages


@pytest.fixture(scope="module")
async def store(test_env: SessionEnv) -> AsyncIterator[RuntimeStore]:
    async with runtime_store(test_env.database_url, "reply-order-tests", max_size=8) as store:
        yield store


def message(agent_id: uuid.UUID, room_id: uuid.UUID, seq: int) -> NewMessage:
    return new_message(agent_id, room_id, seq, source="order")


async def save(
    store: RuntimeStore, sent: NewMessage, ingested: Ingested, texts: list[str], *, keep: bool = False
) -> str | None:
    assert ingested.lease_token is not None
    return await store.save_replies(
        agent_id=sent.agent_id,
        room_id=sent.room_id,
        turn_id=sent.memory_id,
        lease_token=ingested.lease_token,
        replies=[
            (uuid.uuid5(sent.memory_id, str(i)), {"text": t, "source": "order"}) for i, t in enumerate(texts)
        ],
        source="order",
        trajectory=None,
        keep=keep,
    )


def earlier(ingested: Ingested) -> list[tuple[uuid.UUID, Any]]:
    return [(r.id, r.content.get("text")) for r in ingested.earlier_replies]


async def test_the_next_message_reads_the_rooms_latest_replies(store: RuntimeStore) -> None:
    agent_id, room_id = await new_agent(store), uuid.uuid4()
    first = message(agent_id, room_id, 1)
    ingested = await store.ingest(first)
    assert ingested.earlier_replies == []  # a new room has none
    assert await save(store, first, ingested, ["one", "two"]) == "replied"

    second = message(agent_id, room_id, 2)
    after = await store.ingest(second)
    assert earlier(after) == [
        (uuid.uuid5(first.memory_id, "0"), "one"),
        (uuid.uuid5(first.memory_id, "1"), "two"),
    ]
    # Ignored turns leave the room's latest replies as they were: the third message still gets
    # the first one's.
    assert await store.finish_turn(agent_id, second.memory_id, "ignored", lease_token=after.lease_token)
    third = await store.ingest(message(agent_id, room_id, 3))
    assert earlier(third) == earlier(after)
    # A copy of a finished message runs no turn and gets none.
    copy = await store.ingest(first)
    assert copy.state is None
    assert copy.earlier_replies == []


async def test_replies_kept_after_losing_the_room_are_not_the_rooms_latest(store: RuntimeStore) -> None:
    """keep_existing_responses stores the replies of a turn a newer message superseded: the newer
    one's ingest came first, so they are not "before" anything it publishes."""
    agent_id, room_id = await new_agent(store), uuid.uuid4()
    older = message(agent_id, room_id, 1)
    ingested = await store.ingest(older)
    newer = message(agent_id, room_id, 2)
    took = await store.ingest(newer)
    assert took.state == "running"
    assert took.earlier_replies == []
    assert await save(store, older, ingested, ["late"], keep=True) == "replied"
    assert await save(store, newer, took, ["newest"]) == "replied"
    after = await store.ingest(message(agent_id, room_id, 3))
    assert earlier(after) == [(uuid.uuid5(newer.memory_id, "0"), "newest")]


async def test_a_superseded_turn_leaves_no_replies_on_the_room(store: RuntimeStore) -> None:
    agent_id, room_id = await new_agent(store), uuid.uuid4()
    older = message(agent_id, room_id, 1)
    ingested = await store.ingest(older)
    await store.ingest(message(agent_id, room_id, 2))
    assert await save(store, older, ingested, ["too late"]) == "superseded"
    after = await store.ingest(message(agent_id, room_id, 3))
    assert after.earlier_replies == []


async def test_a_save_racing_the_next_message_is_seen_by_it_exactly_when_it_won(store: RuntimeStore) -> None:
    """Many rooms, each with a turn saving its reply while the room's next message is ingested
    at the same moment (saves grouped, as the runtime runs them). Either the save committed first
    (replied) and the next ingest read its reply, or the ingest took the room first and the save
    was superseded: never a reply saved that the next turn did not see."""
    agent_id = await new_agent(store)
    rooms = [uuid.uuid4() for _ in range(120)]
    firsts = [message(agent_id, room, 1) for room in rooms]
    ingested = await asyncio.gather(*(store.ingest(m) for m in firsts))

    async def next_message(room: uuid.UUID) -> Ingested:
        return await store.ingest(message(agent_id, room, 2))

    results = await asyncio.gather(
        *(save(store, m, i, [f"reply {n}"]) for n, (m, i) in enumerate(zip(firsts, ingested, strict=True))),
        *(next_message(room) for room in rooms),
    )
    states, nexts = results[: len(rooms)], results[len(rooms) :]
    seen = 0
    for n, (state, after) in enumerate(zip(states, nexts, strict=True)):
        assert isinstance(after, Ingested)
        if state == "replied":
            assert earlier(after) == [(uuid.uuid5(firsts[n].memory_id, "0"), f"reply {n}")], rooms[n]
            seen += 1
        else:
            assert state == "superseded", (state, rooms[n])
            assert after.earlier_replies == [], rooms[n]
    print(f"\n{seen} of {len(rooms)} saves committed before the next message took the room")
    assert seen + sum(s == "superseded" for s in states) == len(rooms)


# --- the outbox ---


class GatedOutbox(Outbox):
    """The real outbox, whose publish of a chosen reply waits for a gate (a replica slow to publish
    after its commit) or fails (one that dies before publishing); it counts every publish."""

    def __init__(self, bus: Bus) -> None:
        super().__init__(bus)
        self.gates: dict[uuid.UUID, asyncio.Event] = {}
        self.failing: set[uuid.UUID] = set()
        self.calls: list[uuid.UUID] = []

    async def publish(self, agent_id: uuid.UUID, room_id: uuid.UUID, reply: Reply) -> bool:
        self.calls.append(reply.id)
        if reply.id in self.gates:
            await self.gates[reply.id].wait()
        if reply.id in self.failing:
            raise ConnectionError("gone before publishing")
        return await super().publish(agent_id, room_id, reply)


def reply(room_id: uuid.UUID, n: int, source: str) -> Reply:
    return Reply(uuid.uuid5(room_id, f"reply {n}"), f"reply {n}", source, "channel", f"message {n}")


async def on_stream(bus: Bus, agent_id: uuid.UUID, source: str) -> list[str]:
    found = await stream_messages(bus, bus.subjects.outbound(str(agent_id), source))
    return [runtime_pb2.OutboundMessage.FromString(m.data).text for m in found]


async def test_a_reply_another_replica_has_not_published_goes_out_first(bus: Bus) -> None:
    agent_id, room_id, source = uuid.uuid4(), uuid.uuid4(), f"order-{uuid.uuid4().hex[:8]}"
    slow, other = GatedOutbox(bus), GatedOutbox(bus)
    first, second = reply(room_id, 1, source), reply(room_id, 2, source)
    slow.gates[first.id] = asyncio.Event()
    late = asyncio.create_task(slow.publish_turn(agent_id, room_id, [first], []))
    await asyncio.sleep(0.05)
    assert await other.publish_turn(agent_id, room_id, [second], [first]) == 1  # it put the first there
    slow.gates[first.id].set()
    assert await late == 0
    assert await on_stream(bus, agent_id, source) == ["reply 1", "reply 2"]  # the late copy dropped


async def test_a_publish_of_this_process_is_awaited_not_repeated(bus: Bus) -> None:
    agent_id, room_id, source = uuid.uuid4(), uuid.uuid4(), f"order-{uuid.uuid4().hex[:8]}"
    outbox = GatedOutbox(bus)
    first, second, third = (reply(room_id, n, source) for n in (1, 2, 3))
    outbox.gates[first.id] = asyncio.Event()
    under_way = asyncio.create_task(outbox.publish_turn(agent_id, room_id, [first], []))
    await asyncio.sleep(0.05)
    following = asyncio.create_task(outbox.publish_turn(agent_id, room_id, [second], [first]))
    await asyncio.sleep(0.05)
    assert not following.done()  # waiting for the first's publish, not publishing it again
    outbox.gates[first.id].set()
    assert await under_way == 0
    assert await following == 0
    assert await outbox.publish_turn(agent_id, room_id, [third], [second]) == 0
    assert outbox.calls == [first.id, second.id, third.id]  # each once
    assert await on_stream(bus, agent_id, source) == ["reply 1", "reply 2", "reply 3"]


async def test_a_failed_publish_of_this_process_is_made_by_the_next_turn(bus: Bus) -> None:
    agent_id, room_id, source = uuid.uuid4(), uuid.uuid4(), f"order-{uuid.uuid4().hex[:8]}"
    outbox = GatedOutbox(bus)
    first, second = reply(room_id, 1, source), reply(room_id, 2, source)
    outbox.failing.add(first.id)
    with pytest.raises(ConnectionError):
        await outbox.publish_turn(agent_id, room_id, [first], [])
    outbox.failing.clear()
    assert await outbox.publish_turn(agent_id, room_id, [second], [first]) == 1
    assert await on_stream(bus, agent_id, source) == ["reply 1", "reply 2"]


async def test_a_cancelled_follower_does_not_cancel_the_publish_it_waits_for(bus: Bus) -> None:
    agent_id, room_id, source = uuid.uuid4(), uuid.uuid4(), f"order-{uuid.uuid4().hex[:8]}"
    outbox = GatedOutbox(bus)
    first, second = reply(room_id, 1, source), reply(room_id, 2, source)
    outbox.gates[first.id] = asyncio.Event()
    under_way = asyncio.create_task(outbox.publish_turn(agent_id, room_id, [first], []))
    await asyncio.sleep(0.05)
    following = asyncio.create_task(outbox.publish_turn(agent_id, room_id, [second], [first]))
    await asyncio.sleep(0.05)
    following.cancel()
    with pytest.raises(asyncio.CancelledError):
        await following
    outbox.gates[first.id].set()
    assert await under_way == 0
    assert await on_stream(bus, agent_id, source) == ["reply 1"]
