"""When REFLECTION reflects: on a room's every REFLECTION_INTERVAL-th turn (default 4, elizaOS's
cadence), over the messages since the last; with an interval of 1 after every message that can
carry a fact (four words or more)."""

from __future__ import annotations

import uuid
from typing import Any

import pytest

from parley_runtime.character import Character
from parley_runtime.plugins.reflection import _question, _should_reflect
from parley_runtime.sdk import HistoryLine, MessageView, TurnContext

AGENT = uuid.uuid4()


class _Services:
    def __init__(self, settings: dict[str, Any]) -> None:
        self.settings = settings

    def get_setting(self, key: str) -> object | None:
        return self.settings.get(key)


def ctx(
    text: str = "my sister lives in Lisbon",
    *,
    room_turn: int,
    settings: dict[str, Any] | None = None,
    autonomous: bool = False,
    sender: uuid.UUID | None = None,
    history: int = 0,
) -> TurnContext:
    message = MessageView(
        id=uuid.uuid4(),
        text=text,
        source="t",
        channel_id="c",
        room_id=uuid.uuid4(),
        room_type="DM",
        sender_id=sender or uuid.uuid4(),
        sender_name="Ana",
        autonomous=autonomous,
    )
    return TurnContext(
        agent_id=AGENT,
        character=Character(name="A"),
        message=message,
        role="MEMBER",
        history=[HistoryLine("e", "Ana", f"line {i}", "") for i in range(history)],
        participants=[],
        services=_Services(settings or {}),  # type: ignore[arg-type]
        room_turn=room_turn,
    )


async def due(turns: range, **options: Any) -> list[int]:
    return [n for n in turns if await _should_reflect(ctx(room_turn=n, **options))]


async def test_by_default_every_fourth_turn_of_a_room_whatever_its_words() -> None:
    assert await due(range(1, 17)) == [4, 8, 12, 16]
    assert await _should_reflect(ctx("ok", room_turn=8))  # it reflects on the turns since, not one message


@pytest.mark.parametrize("interval", [2, "3", 5, " 7 "])
async def test_the_interval_is_a_setting(interval: object) -> None:
    every = int(str(interval))
    expected = list(range(every, 22, every))
    assert await due(range(1, 22), settings={"REFLECTION_INTERVAL": interval}) == expected


async def test_an_interval_of_one_reflects_on_each_message_that_can_carry_a_fact() -> None:
    settings = {"REFLECTION_INTERVAL": 1}
    assert await due(range(1, 6), settings=settings) == [1, 2, 3, 4, 5]
    assert not await _should_reflect(ctx("hi there you", room_turn=3, settings=settings))


@pytest.mark.parametrize("bad", [0, -4, "often", "2.5", True])
async def test_an_interval_that_is_not_a_whole_number_of_turns_is_the_default(bad: object) -> None:
    assert await due(range(1, 13), settings={"REFLECTION_INTERVAL": bad}) == [4, 8, 12]


async def test_never_when_off_autonomous_the_agents_own_words_or_the_turn_is_unknown() -> None:
    assert await due(range(1, 9), settings={"REFLECTION": "false"}) == []
    assert await due(range(1, 9), autonomous=True) == []
    assert await due(range(1, 9), sender=AGENT) == []
    assert not await _should_reflect(ctx(room_turn=0))  # a context without the room's turn


@pytest.mark.parametrize(("interval", "lines"), [(1, 8), (4, 8), (6, 12), (10, 20)])
async def test_the_question_reads_back_to_the_last_reflection(interval: int, lines: int) -> None:
    question = _question(ctx(room_turn=interval, settings={"REFLECTION_INTERVAL": interval}, history=30))
    assert f"line {30 - lines}" in question
    assert f"line {30 - lines - 1}\n" not in question
    assert "Ana: my sister lives in Lisbon" in question
