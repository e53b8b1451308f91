"""confirm: actions that need a person's confirmation are asked for, not run. Each proposal is
stored (``runtime.tool_call``: the parameters stay in the runtime, authz gets their digest), put
in authz as a pending decision, and the turn replies with one prompt naming each approval id."""

from __future__ import annotations

from datetime import timedelta

from parley.v1 import authz_pb2
from parley.v1.authz_nats import AuthzClient

from ... import ids
from ...records import Invocation, ToolCall
from ...sdk import Content
from ...store import RuntimeStore
from ..approvals import arguments_digest, summary, tool_call_id, ttl_seconds
from ..inbound import Inbound
from ..pipeline import Stage, Stop
from ..ports import Events
from ..state import Turn


def invocation_of(message: Inbound) -> Invocation:
    proto = message.proto
    return Invocation(
        source=proto.source,
        message_id=proto.message_id,
        channel_id=proto.channel_id,
        sender_id=proto.sender_id,
        sender_name=proto.sender_name,
        sender_username=proto.sender_username,
        room_type=message.room_type,
        world_id=proto.world_id,
        text=proto.text,
        in_reply_to=proto.in_reply_to,
        metadata=dict(proto.metadata),
        attachments=message.attachments,
    )


class Confirm(Stage):
    name = "confirm"

    def __init__(self, store: RuntimeStore, authz: AuthzClient, events: Events) -> None:
        self.store = store
        self.authz = authz
        self.events = events

    async def run(self, turn: Turn) -> Stop | None:
        if turn.proposals:
            turn.replies.append(await self.propose(turn))
        return None

    async def propose(self, turn: Turn) -> Content:
        agent = turn.agent
        message_id = ids.response_id(turn.id, len(turn.replies))
        ttl = ttl_seconds(agent)
        invocation = invocation_of(turn.message)
        lines = []
        for call_index, proposal in enumerate(turn.proposals):
            # A redelivered turn gets the first proposal back: authz hears the same call again.
            call = await self.store.save_tool_call(
                ToolCall(
                    id=tool_call_id(turn.id, proposal.index),
                    agent_id=agent.id,
                    turn_id=turn.id,
                    action_index=proposal.index,
                    call_index=call_index,
                    room_id=turn.room_id,
                    message_id=message_id,
                    action=proposal.action.name,
                    params=proposal.params,
                    requester_id=turn.message.sender_id,
                    role=turn.ctx.role,
                    invocation=invocation,
                )
            )
            assert call.created_at is not None, "stored proposals carry their time"
            shown = summary(agent, call.action, call.params)
            request = authz_pb2.PutPendingRequest(
                agent_id=str(agent.id),
                tool_call_id=call.id,
                conversation_id=str(call.room_id),
                message_id=str(call.message_id),
                call_index=call.call_index,
                tool=call.action,
                args_digest=arguments_digest(call.params),
                summary=shown,
                on_expiry=authz_pb2.TOOL_DECISION_DENY,
            )
            request.proposed_at.FromDatetime(call.created_at)
            request.expires_at.FromDatetime(call.created_at + timedelta(seconds=ttl))
            await self.authz.PutPending(request)
            lines.append(f"{call.call_index + 1}. {shown} (approval id {call.id})")
        await self.events.emit(agent, "CONFIRMATION_REQUESTED", turn.id, turn.room_id, calls=str(len(lines)))
        text = (
            "Before I go ahead I need your confirmation:\n"
            + "\n".join(lines)
            + "\nAnswer yes to go ahead or no to cancel."
        )
        return Content(text=text, actions=("CONFIRM",))
