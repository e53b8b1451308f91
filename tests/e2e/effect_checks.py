"""What the crash test of test_runtime_scale.py checks about the `effects` test plugin's
RECORD_EFFECT (tests/plugins/effects.py): its own log against the runtime's effect claims and
trajectories."""

from __future__ import annotations

import collections
import uuid
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import psycopg
from psycopg.rows import dict_row

if TYPE_CHECKING:
    from test_runtime_scale import Sent


def check_effects_once(
    database_url: str, agent: str, record: Sequence[Sent], turns: dict[uuid.UUID, dict[str, Any]]
) -> dict[str, int]:
    """RECORD_EFFECT ran at most once per turn (its own log says so); a claim without a result
    was reported UNCERTAIN_EFFECT by the turn that found it, or never found (turn superseded)."""
    ids = [s.turn_id for s in record]
    with psycopg.connect(database_url, row_factory=dict_row) as conn:
        runs = collections.Counter(
            row["turn_id"]
            for row in conn.execute(
                "SELECT turn_id FROM public.effect_log WHERE turn_id = ANY(%s::uuid[])", (ids,)
            ).fetchall()
        )
        claims = {
            row["turn_id"]: row
            for row in conn.execute(
                "SELECT turn_id, action, result FROM runtime.effect_claim"
                " WHERE agent_id = %s AND turn_id = ANY(%s::uuid[]) AND action_index = 0",
                (agent, ids),
            ).fetchall()
        }
    twice = {str(t): n for t, n in runs.items() if n > 1}
    assert not twice, f"RECORD_EFFECT ran more than once for these turns: {twice}"
    unclaimed = [str(t) for t in runs if t not in claims]
    assert not unclaimed, f"RECORD_EFFECT ran without an effect claim: {unclaimed[:5]}"
    figures = collections.Counter[str]()
    for sent in record:
        turn = turns[sent.turn_id]
        claim = claims.get(sent.turn_id)
        actions = (turn["trajectory"] or {}).get("actions", [])
        effect = next((a for a in actions if a.get("index") == 0), None)
        if claim is None:
            # Never reached the action: superseded before (or at) ingest.
            assert runs[sent.turn_id] == 0
            assert turn["state"] == "superseded", (
                f"turn {sent.turn_id} ({turn['state']}) never ran its action"
            )
            figures["superseded before the action"] += 1
        elif claim["result"] is not None:
            figures["ran once" if runs[sent.turn_id] == 1 else "claimed, result, no log row"] += 1
            assert runs[sent.turn_id] == 1 or not claim["result"]["success"], (
                f"turn {sent.turn_id}: a successful RECORD_EFFECT result but {runs[sent.turn_id]} log rows"
            )
        elif effect is not None:
            # The claim has no result: the attempt that wrote it died. The retry found it.
            assert effect["outcome"] == "uncertain", f"turn {sent.turn_id}: {effect}"
            assert str(effect["result"]["error"]).startswith("UNCERTAIN_EFFECT"), effect
            figures["uncertain (claim found by a retry)"] += 1
        else:
            # The claim has no result and no retry ran the action: the retry was superseded.
            assert turn["state"] == "superseded", (
                f"turn {sent.turn_id} ({turn['state']}) has a claim without result and no UNCERTAIN_EFFECT"
            )
            figures["claim without result, retry superseded"] += 1
    return dict(figures)


async def effect_pids(database_url: str, turn: uuid.UUID) -> list[int]:
    """The processes that ran RECORD_EFFECT for ``turn``, from the plugin's own log."""
    async with await psycopg.AsyncConnection.connect(database_url) as conn:
        cur = await conn.execute("SELECT pid FROM public.effect_log WHERE turn_id = %s", (turn,))
        return [int(row[0]) for row in await cur.fetchall()]


def check_killed_inside_the_effect(
    database_url: str,
    agent: str,
    held: Sequence[Sent],
    turns: dict[uuid.UUID, dict[str, Any]],
    killed_inside: dict[uuid.UUID, int],
) -> None:
    """Each aimed kill hit the window between the effect and its recorded result: the effect ran
    once, in the killed replica; its claim has no result; the redelivery reported
    UNCERTAIN_EFFECT and still answered."""
    assert set(killed_inside) == {s.turn_id for s in held}
    with psycopg.connect(database_url, row_factory=dict_row) as conn:
        for sent in held:
            runs = conn.execute(
                "SELECT pid FROM public.effect_log WHERE turn_id = %s", (sent.turn_id,)
            ).fetchall()
            assert [r["pid"] for r in runs] == [killed_inside[sent.turn_id]], (
                f"held turn {sent.turn_id}: effect runs {runs}, killed pid {killed_inside[sent.turn_id]}"
            )
            claim = conn.execute(
                "SELECT result FROM runtime.effect_claim"
                " WHERE agent_id = %s AND turn_id = %s AND action_index = 0",
                (agent, sent.turn_id),
            ).fetchone()
            assert claim is not None, f"held turn {sent.turn_id} has no effect claim"
            assert claim["result"] is None, (
                f"held turn {sent.turn_id}: the killed run recorded {claim['result']}"
            )
    for sent in held:
        turn = turns[sent.turn_id]
        assert (turn["state"], turn["attempts"] > 1) == ("replied", True), (
            f"held turn {sent.turn_id}: {turn['state']} after {turn['attempts']} attempts"
        )
        actions = (turn["trajectory"] or {}).get("actions", [])
        effect = next((a for a in actions if a.get("index") == 0), None)
        assert effect is not None, f"held turn {sent.turn_id}: no action in its trajectory"
        assert effect["outcome"] == "uncertain", f"held turn {sent.turn_id}: {effect}"
        assert str(effect["result"]["error"]).startswith("UNCERTAIN_EFFECT"), effect
