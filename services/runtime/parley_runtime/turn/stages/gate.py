"""gate: turns that must not reach the model - a disabled agent, the agent's own message, a DM
from someone the DM policy does not admit (pairing), a muted room or world."""

from __future__ import annotations

from datetime import UTC, datetime

from parley_clients.pairing import PairingGate, dm_policy

from ...names import DM_ROOMS
from ...sdk import Content
from ...store import RuntimeStore
from ..pipeline import Stage, Stop
from ..state import Turn


class Gate(Stage):
    name = "gate"

    def __init__(self, store: RuntimeStore, pairing: PairingGate) -> None:
        self.store = store
        self.pairing = pairing

    async def run(self, turn: Turn) -> Stop | None:
        reason = await self._refusal(turn)
        if reason is None:
            return None
        if turn.replies:  # the pairing challenge: said instead of a turn, no model call
            turn.gated = True
            return Stop.answered()
        await self.store.finish_turn(
            turn.agent.id, turn.id, "ignored", lease_token=turn.lease_token, reason=reason
        )
        return Stop.finished("ignored")

    async def _refusal(self, turn: Turn) -> str | None:
        agent, message = turn.agent, turn.message
        if not agent.enabled:
            return "disabled"
        if message.from_self and not message.from_runtime:
            return "self"
        if message.room_type in DM_ROOMS and not message.from_runtime:
            policy = dm_policy(
                agent.setting(f"DM_POLICY_{message.source.upper()}") or agent.setting("DM_POLICY") or "open",
                "DM_POLICY",
            )
            admission = await self.pairing.admit(
                agent_id=str(agent.id),
                channel=message.source,
                sender_id=message.proto.sender_id,
                policy=policy,
                agent_name=agent.character.name,
                metadata={"sender_name": message.sender_name},
            )
            turn.trajectory["admission"] = {"policy": policy.value, "reason": admission.reason}
            if not admission.serve:
                if admission.reply:
                    turn.replies.append(Content(text=admission.reply, actions=("PAIRING",)))
                return f"pairing:{admission.reason}"
        now = datetime.now(UTC)
        room = turn.ingested.room_state
        if room is not None:
            muted, expired = room.active(now)
            if expired:
                await self.store.lift_expired_mute(agent.id, turn.room_id)
            elif muted:
                return "muted"
        world = turn.ingested.world_mute
        if world is not None:
            muted, expired = world.active(now)
            if expired and message.world_id is not None:
                await self.store.lift_expired_world_mute(agent.id, message.world_id)
            elif muted:
                return "world_muted"
        return None
