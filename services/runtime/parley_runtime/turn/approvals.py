"""What the turn, the CHOICE action and the confirmation flow share about actions that wait for a
person: which actions need one, how a call is named and bound to its parameters, what a person
is shown, and the room's pending calls and their decisions (through authz).

The flow itself: ``stages/confirm.py`` proposes, CHOICE or an operator decides,
``confirmations.py`` runs an approved call once and continues the conversation.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from parley.v1 import authz_pb2, common_pb2
from parley.v1.authz_nats import AuthzClient
from parley_platform import canonical

from ..agent_settings import setting_list
from ..agents.directory import AgentInfo
from ..sdk import Action, PendingCall
from ..store import RuntimeStore

CONFIRM_ACTIONS_SETTING = "CONFIRM_ACTIONS"
TTL_SETTING = "CONFIRMATION_TTL_SECONDS"
DEFAULT_TTL_SECONDS = 24 * 3600.0
MAX_SUMMARY = 2000
DECIDE_RESULTS = {
    authz_pb2.DECIDE_RESULT_CLAIMED: "approved",
    authz_pb2.DECIDE_RESULT_DENIED: "denied",
    authz_pb2.DECIDE_RESULT_IN_FLIGHT: "already approved",
    authz_pb2.DECIDE_RESULT_RECORDED: "already decided",
}


def needs_confirmation(agent: AgentInfo, action: Action) -> bool:
    if action.needs_confirmation:
        return True
    return action.name in {name.upper() for name in setting_list(agent.setting(CONFIRM_ACTIONS_SETTING))}


def tool_call_id(turn_id: uuid.UUID, action_index: int) -> str:
    return f"{turn_id}:{action_index}"


def ttl_seconds(agent: AgentInfo) -> float:
    return float(str(agent.setting(TTL_SETTING) or DEFAULT_TTL_SECONDS))


def arguments_digest(params: Mapping[str, Any]) -> str:
    """The canonical digest of the parameters; canonical JSON refuses fractions, so a float is
    bound by its shortest decimal text."""

    def integral(value: Any) -> Any:
        if isinstance(value, float):
            return repr(value)
        if isinstance(value, Mapping):
            return {str(k): integral(v) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return [integral(v) for v in value]
        return value

    return canonical.tool_arguments_digest(integral(dict(params)))


def summary(agent: AgentInfo, action: str, params: Mapping[str, Any]) -> str:
    """What a person approves: the action and its parameters, secrets redacted."""
    shown = json.dumps(params, ensure_ascii=False, sort_keys=True, default=str)
    text = agent.redactor.redact(f"{action} {shown}" if params else action)
    return text if len(text) <= MAX_SUMMARY else text[: MAX_SUMMARY - 1] + "…"


@dataclass(frozen=True)
class Approvals:
    """The room's calls waiting for a decision, and deciding them (the CHOICE action)."""

    authz: AuthzClient
    store: RuntimeStore

    async def pending(self, agent: AgentInfo, room_id: uuid.UUID) -> list[PendingCall]:
        reply = await self.authz.ListPendingToolCalls(
            authz_pb2.ListPendingToolCallsRequest(
                agent_id=str(agent.id), conversation_id=str(room_id), page=common_pb2.PageRequest(limit=100)
            )
        )
        calls = list(reply.tool_calls)
        proposed = {
            c.id: c for c in await self.store.get_tool_calls(agent.id, [c.tool_call_id for c in calls])
        }
        return [
            PendingCall(c.tool_call_id, c.tool, c.summary, str(proposed[c.tool_call_id].requester_id))
            for c in calls
            if c.tool_call_id in proposed  # proposed by this runtime, not by another executor
        ]

    async def decide(
        self, agent: AgentInfo, call_id: str, *, approve: bool, reason: str, decided_by: str
    ) -> str:
        """Record the decision; the approval's event, not this reply, makes the action run."""
        reply = await self.authz.Decide(
            authz_pb2.DecideRequest(
                agent_id=str(agent.id),
                tool_call_id=call_id,
                decision=authz_pb2.TOOL_DECISION_APPROVE if approve else authz_pb2.TOOL_DECISION_DENY,
                reason=reason,
                decided_by=decided_by,
            )
        )
        return DECIDE_RESULTS.get(reply.result, "decided")
