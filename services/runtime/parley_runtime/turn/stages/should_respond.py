"""should-respond: whether the agent takes part. Rooms of one person, configured sources and room
types, a mention or a reply to the agent, a followed room: yes without asking; otherwise the small
model decides (SHOULD_RESPOND_MODEL=large for the large one). Not responding is remembered: an
IGNORE memory in reply to the message."""

from __future__ import annotations

import re

from ... import ids, templating
from ...agent_settings import setting_list
from ...names import PRIVATE_ROOMS
from ...parser import parse_response
from ...store import RuntimeStore
from ..pipeline import Stage, Stop
from ..ports import Model
from ..prompt import Segment
from ..state import Turn

PROMPT = """# Should {name} respond?
You are {name}. Decide whether to take part in this conversation. Answer RESPOND when the
message is for you or you have something useful to add, IGNORE when it is not for you,
STOP when you were asked to be quiet.

{conversation}
Answer with exactly:
<response><name>{name}</name><reasoning>one sentence</reasoning>
<action>RESPOND|IGNORE|STOP</action></response>
"""
TEMPLATE = "shouldRespondTemplate"
BRACKETED = re.compile(r"\[(RESPOND|IGNORE|STOP)\]", re.IGNORECASE)


class ShouldRespond(Stage):
    name = "should_respond"

    def __init__(self, store: RuntimeStore, model: Model, *, trajectory_logging: bool) -> None:
        self.store = store
        self.model = model
        self.trajectory_logging = trajectory_logging

    async def run(self, turn: Turn) -> Stop | None:
        respond, why = await self.decide(turn)
        if respond:
            return None
        message = turn.message
        content = {
            "text": "",
            "actions": ["IGNORE"],
            "simple": True,
            "source": message.source,
            "inReplyTo": message.proto.message_id,
            "reason": why,
        }
        await self.store.save_ignore(
            agent_id=turn.agent.id,
            room_id=turn.room_id,
            turn_id=turn.id,
            memory_id=ids.response_id(turn.id),
            lease_token=turn.lease_token,
            content=content,
            source=message.source,
            reason=why,
            trajectory=turn.recorded(self.trajectory_logging),
        )
        return Stop.finished("ignored")

    async def decide(self, turn: Turn) -> tuple[bool, str]:
        agent, ctx, message = turn.agent, turn.ctx, turn.message
        if message.from_runtime:
            return True, message.origin.value
        if message.room_type in PRIVATE_ROOMS:
            return True, "room_type"
        if message.source in setting_list(agent.setting("ALWAYS_RESPOND_SOURCES")):
            return True, "always_respond_source"
        if message.room_type in {r.upper() for r in setting_list(agent.setting("ALWAYS_RESPOND_ROOM_TYPES"))}:
            return True, "always_respond_room_type"
        if message.proto.mentions_agent or turn.ingested.replies_to_agent:
            return True, "addressed"
        room = turn.ingested.room_state
        if room is not None and room.state == "FOLLOWED":
            return True, "followed"
        conversation = "".join(f"{h.name}: {h.text}\n" for h in ctx.history[-10:])
        conversation += f"{message.sender_name}: {message.text}\n"
        large = str(agent.setting("SHOULD_RESPOND_MODEL") or "small").lower() == "large"
        template = agent.character.templates.get(TEMPLATE)
        if template:  # the character's own (elizaOS's placeholders)
            values = {
                "providers": conversation,
                "recentMessages": conversation,
                "senderName": message.sender_name,
            }
            prompt = templating.render(template, agent.character, values)
        else:
            prompt = PROMPT.format(name=agent.character.name, conversation=conversation)
        answer = await self.model.generate(agent.id, [Segment(prompt, stable=False)], small=not large)
        parsed = parse_response(answer)
        decision = (parsed.fields.get("action", "") if parsed else "").strip().upper()
        if not decision:  # elizaOS 0.x templates answer [RESPOND], [IGNORE] or [STOP]
            bracketed = BRACKETED.search(answer)
            decision = bracketed[1].upper() if bracketed else ""
        turn.trajectory["should_respond"] = {"model": "large" if large else "small", "output": answer[:2000]}
        if template:
            turn.trajectory["should_respond"]["template"] = TEMPLATE
            if self.trajectory_logging:
                turn.trajectory["should_respond"]["prompt"] = prompt[:8000]
        if decision == "RESPOND":
            return True, "model"
        return False, f"model:{decision.lower() or 'unparsable'}"
