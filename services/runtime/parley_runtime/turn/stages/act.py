"""act: the planned actions, in order (see ``turn/actions.py`` for what runs one)."""

from __future__ import annotations

from ...parser import normalize_actions
from ..actions import ActionRunner
from ..pipeline import Stage, Stop
from ..state import Turn


class Act(Stage):
    name = "act"

    def __init__(self, runner: ActionRunner) -> None:
        self.runner = runner

    async def run(self, turn: Turn) -> Stop | None:
        assert turn.ctx.parsed is not None, "act runs after plan"
        parsed = turn.ctx.parsed
        actions = normalize_actions(parsed)
        if parsed.text.strip() and not any(turn.agent.catalog.find(name) for name in actions):
            # The model answered but named no action it has (small models invent some): the text is
            # still its answer. The unknown names are recorded as unknown, and nothing runs for them.
            actions = [*actions, "REPLY"]
        turn.trajectory["actions"] = []
        for index, name in enumerate(actions):
            await self.runner.run(turn, index, name)
        return None
