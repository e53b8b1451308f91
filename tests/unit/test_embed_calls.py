"""``EmbedCalls`` (turn/embeddings.py): an agent's embedding calls made while another is under way
go out together as the next call. Many concurrent callers and a counting embedder whose calls are
held open until the test lets them go: how many calls were made, with which texts, and that every
caller got the vectors of its own texts; a refused text fails only its caller; a caller that gives
up leaves the others' call alone; agents never share a call; a call stays within the gateway's
limit of texts."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Sequence

import pytest

from parley_platform import codes
from parley_platform.errors import ParleyError
from parley_runtime.turn.embeddings import EmbedCalls

pytestmark = pytest.mark.timeout(30)


def vector(text: str) -> list[float]:
    return [float(len(text)), float(sum(map(ord, text)))]


class Embedder:
    """Embeds each text as ``vector(text)`` and refuses a call with a "too long" text, as the
    gateway would. Each call waits until ``release`` is set, so calls pile up behind it."""

    def __init__(self) -> None:
        self.calls: list[tuple[uuid.UUID, list[str]]] = []
        self.release = asyncio.Event()
        self.release.set()

    async def __call__(self, texts: Sequence[str], agent_id: uuid.UUID) -> list[list[float]]:
        self.calls.append((agent_id, list(texts)))
        await self.release.wait()
        if "too long" in texts:
            raise codes.INVALID_ARGUMENT("texts[0] is over 65536 characters")
        return [vector(t) for t in texts]


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def one_under_way(
    **options: int,
) -> tuple[Embedder, EmbedCalls, uuid.UUID, asyncio.Future[list[list[float]]]]:
    """An embedder held, and an agent's first call under way on it."""
    embedder = Embedder()
    embedder.release.clear()
    calls = EmbedCalls(embedder, **options)
    agent = uuid.uuid4()
    first = asyncio.ensure_future(calls(["first"], agent))
    await settle()
    return embedder, calls, agent, first


async def test_a_call_alone_goes_out_at_once_with_its_texts() -> None:
    embedder = Embedder()
    calls = EmbedCalls(embedder)
    agent = uuid.uuid4()
    assert await calls(["hello", "there"], agent) == [vector("hello"), vector("there")]
    assert embedder.calls == [(agent, ["hello", "there"])]
    assert await calls(["again"], agent) == [vector("again")]
    assert len(embedder.calls) == 2  # the agent was idle again: nothing waited for a batch


async def test_calls_made_while_one_is_under_way_share_the_next_and_each_gets_its_own() -> None:
    embedder, calls, agent, first = await one_under_way()
    rest = [asyncio.ensure_future(calls([f"text {i}", f"more {i}"], agent)) for i in range(63)]
    await settle()
    assert len(embedder.calls) == 1  # the others wait for the call under way
    embedder.release.set()
    assert await first == [vector("first")]
    answers = await asyncio.gather(*rest)
    assert [answer for answer in answers] == [[vector(f"text {i}"), vector(f"more {i}")] for i in range(63)]
    # Two calls in all: the first, then the other 63 callers' 126 texts together, in their order.
    assert len(embedder.calls) == 2
    assert embedder.calls[1] == (agent, [t for i in range(63) for t in (f"text {i}", f"more {i}")])


async def test_a_refused_text_fails_only_its_caller() -> None:
    embedder, calls, agent, first = await one_under_way()
    good = [asyncio.ensure_future(calls([f"text {i}"], agent)) for i in range(5)]
    bad = asyncio.ensure_future(calls(["too long"], agent))
    await settle()
    embedder.release.set()
    await first
    assert await asyncio.gather(*good) == [[vector(f"text {i}")] for i in range(5)]
    with pytest.raises(ParleyError) as refused:
        await bad
    assert refused.value.code == "INVALID_ARGUMENT"
    # The first, the shared call the refused text failed, then each of the six callers alone.
    assert len(embedder.calls) == 2 + 6


async def test_a_caller_that_gives_up_leaves_the_others_call_alone() -> None:
    embedder, calls, agent, first = await one_under_way()
    stays = asyncio.ensure_future(calls(["stays"], agent))
    leaves = asyncio.ensure_future(calls(["leaves"], agent))
    await settle()
    leaves.cancel()
    first.cancel()  # the call under way given up by its own caller: the next goes out all the same
    await settle()
    embedder.release.set()
    assert await stays == [vector("stays")]
    assert leaves.cancelled()
    assert first.cancelled()
    assert embedder.calls[-1] == (agent, ["stays"])  # the caller that left is not asked for


async def test_agents_never_share_a_call() -> None:
    embedder = Embedder()
    embedder.release.clear()
    calls = EmbedCalls(embedder)
    agents = [uuid.uuid4() for _ in range(3)]
    firsts = [asyncio.ensure_future(calls([f"first {a}"], a)) for a in agents]
    await settle()
    rest = [asyncio.ensure_future(calls([f"text {a} {i}"], a)) for a in agents for i in range(4)]
    await settle()
    embedder.release.set()
    await asyncio.gather(*firsts)
    answers = await asyncio.gather(*rest)
    assert answers == [[vector(f"text {a} {i}")] for a in agents for i in range(4)]
    for agent_id, texts in embedder.calls:
        assert all(str(agent_id) in text for text in texts)
    assert len(embedder.calls) == 6  # per agent: its first call, then its other four together


async def test_a_shared_call_stays_within_the_gateways_limit() -> None:
    embedder, calls, agent, first = await one_under_way(max_texts=256)
    rest = [asyncio.ensure_future(calls([f"t {i} {k}" for k in range(10)], agent)) for i in range(60)]
    await settle()
    embedder.release.set()
    await first
    answers = await asyncio.gather(*rest)
    assert answers == [[vector(f"t {i} {k}") for k in range(10)] for i in range(60)]
    sizes = [len(texts) for _, texts in embedder.calls[1:]]
    assert sum(sizes) == 600
    assert max(sizes) <= 256
    assert len(sizes) == 3  # 25, 25 and 10 callers' texts
