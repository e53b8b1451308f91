"""One platform message per reply (parley_chat.delivery): chunks and durable replies racing, in any
order, any number of times, give one message whose final text is the durable reply's."""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from parley_chat.delivery import Delivery, Entry, Ledger, PlatformError, fit


@dataclass
class Board:
    """A platform in memory: message handle → texts; a send can be made slow to open race windows."""

    limit: int = 100
    messages: dict[str, list[str]] = field(default_factory=dict)
    deleted: set[str] = field(default_factory=set)
    delay: float = 0.0
    fail_edits: bool = False

    async def send(self, channel_id: str, in_reply_to: str, text: str) -> str:
        await asyncio.sleep(self.delay)
        handle = f"m{len(self.messages) + 1}"
        self.messages[handle] = [text]
        return handle

    async def edit(self, channel_id: str, handle: str, text: str) -> None:
        await asyncio.sleep(self.delay / 2)
        if handle in self.deleted:
            raise PlatformError("message to edit not found", gone=True)
        if self.fail_edits:
            raise PlatformError("Too Many Requests: retry after 3")
        self.messages[handle].append(text)

    async def delete(self, channel_id: str, handle: str) -> None:
        self.deleted.add(handle)


async def test_chunks_then_reply_give_one_message_with_the_reply_text() -> None:
    board = Board()
    delivery = Delivery(board, Ledger(None), edit_interval=0.0)
    for seq, delta in enumerate(["Hel", "lo ", "there"], 1):
        await delivery.chunk("r1", "c", "", seq, delta)
    await asyncio.sleep(0.01)
    await delivery.reply("r1", "c", "", "Hello there!")
    assert list(board.messages) == ["m1"]
    assert board.messages["m1"][0] == "Hel"
    assert board.messages["m1"][-1] == "Hello there!"


@pytest.mark.parametrize("seed", range(20))
async def test_racing_chunks_and_repeated_replies_give_one_message(seed: int) -> None:
    """Chunks, the reply and copies of the reply delivered concurrently in a random order."""
    rng = random.Random(seed)
    board = Board(delay=0.002)
    delivery = Delivery(board, Ledger(None), edit_interval=0.001)
    words = [f"w{i} " for i in range(1, 9)]
    calls = [delivery.chunk("r", "c", "", i, w) for i, w in enumerate(words, 1)]
    calls += [delivery.reply("r", "c", "", "the final text") for _ in range(3)]
    rng.shuffle(calls)
    await asyncio.gather(*calls)
    await asyncio.sleep(0.05)  # a pending throttled edit, were one left, would show now
    assert len(board.messages) == 1
    [texts] = board.messages.values()
    assert texts[-1] == "the final text"
    assert delivery.counts.duplicates == 2


async def test_a_reply_delivered_again_after_a_restart_edits_nothing_and_sends_nothing(
    tmp_path: Path,
) -> None:
    board = Board()
    first = Delivery(board, Ledger(tmp_path / "ledger.sqlite"))
    await first.chunk("r", "c", "", 1, "Streaming")
    await first.close()  # the process stops before the reply came
    second = Delivery(board, Ledger(tmp_path / "ledger.sqlite"))
    await second.reply("r", "c", "", "Streaming, finished.")
    await second.reply("r", "c", "", "Streaming, finished.")
    assert board.messages == {"m1": ["Streaming", "Streaming, finished."]}
    await second.close()


async def test_a_cancelled_stream_is_deleted_and_late_chunks_are_ignored() -> None:
    board = Board()
    delivery = Delivery(board, Ledger(None), edit_interval=0.0)
    await delivery.chunk("r", "c", "", 1, "Half")
    await delivery.chunk("r", "c", "", 2, "", final=True, outcome="cancelled")
    assert board.deleted == {"m1"}
    await delivery.reply("done", "c", "", "Other")
    await delivery.chunk("done", "c", "", 1, "late")
    assert board.messages["m2"] == ["Other"]


async def test_a_deleted_streamed_message_still_gets_the_answer_and_long_texts_are_cut() -> None:
    board = Board(limit=10)
    delivery = Delivery(board, Ledger(None), edit_interval=0.0)
    await delivery.chunk("r", "c", "", 1, "Hi")
    board.deleted.add("m1")  # someone removed it
    await delivery.reply("r", "c", "", "A much longer answer")
    assert board.messages["m2"] == [fit("A much longer answer", 10)]
    assert len(board.messages["m2"][0]) == 10


def test_the_ledger_forgets_old_entries(tmp_path: Path) -> None:
    ledger = Ledger(tmp_path / "l.sqlite")
    ledger.put("old", Entry("c", "m1", True))
    ledger.forget_older_than(3600)
    assert ledger.get("old") is not None
    ledger.forget_older_than(-1)
    assert ledger.get("old") is None
    ledger.close()


async def test_a_final_edit_refused_for_now_is_retried_not_sent_twice() -> None:
    """A rate-limited final edit must not leave the streamed message and a second one: the reply
    fails (its caller retries it later), and the retry edits the same message."""
    board = Board()
    delivery = Delivery(board, Ledger(None), edit_interval=0.0)
    await delivery.chunk("r", "c", "", 1, "Almost")
    board.fail_edits = True
    with pytest.raises(PlatformError):
        await delivery.reply("r", "c", "", "Almost done.")
    board.fail_edits = False
    await delivery.reply("r", "c", "", "Almost done.")
    assert board.messages == {"m1": ["Almost", "Almost done."]}
