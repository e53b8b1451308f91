"""deliver: the replies are stored (only while the turn still holds the room's lease), then
published to the connector, after the room's earlier replies (``Outbox.publish_turn``: in message
order, whichever replica saved those); a turn that lost the room to a newer message is superseded
and says nothing. The inbound message is acked after this, so a reply is durable before its
message is."""

from __future__ import annotations

from parley_platform.logging import get_logger

from ... import ids
from ...store import RuntimeStore
from ..pipeline import Stage, Stop
from ..ports import Events, Outbox
from ..reply import Reply
from ..state import Turn, TurnMetrics
from ..streaming import COMPLETED, REVISED

log = get_logger(__name__)


def replies_of(turn: Turn) -> list[Reply]:
    message = turn.message.proto
    return [
        Reply.of(
            ids.response_id(turn.id, index),
            content,
            source=message.source,
            channel_id=message.channel_id,
            in_reply_to=message.message_id,
        ).redacted(turn.agent.redactor.redact)
        for index, content in enumerate(turn.replies)
    ]


class Deliver(Stage):
    name = "deliver"
    closing = True

    def __init__(
        self,
        store: RuntimeStore,
        outbox: Outbox,
        events: Events,
        metrics: TurnMetrics,
        *,
        trajectory_logging: bool,
    ) -> None:
        self.store = store
        self.outbox = outbox
        self.events = events
        self.metrics = metrics
        self.trajectory_logging = trajectory_logging

    async def run(self, turn: Turn) -> Stop | None:
        turn.outcome = await self._deliver(turn)
        return None

    async def _deliver(self, turn: Turn) -> str:
        agent = turn.agent
        aborted = turn.abort.seal()
        if aborted is not None:
            turn.trajectory["aborted"] = aborted.reason
            await self.store.finish_turn(
                agent.id,
                turn.id,
                aborted.outcome,
                lease_token=turn.lease_token,
                reason=aborted.reason,
                trajectory=turn.recorded(self.trajectory_logging),
            )
            self.metrics.aborted.labels(aborted.outcome).inc()
            return aborted.outcome
        if not turn.replies:
            await self.store.finish_turn(
                agent.id,
                turn.id,
                "ignored",
                lease_token=turn.lease_token,
                reason="no_reply",
                trajectory=turn.recorded(self.trajectory_logging),
            )
            return "ignored"
        replies = replies_of(turn)
        state = await self.store.save_replies(
            agent_id=agent.id,
            room_id=turn.room_id,
            turn_id=turn.id,
            lease_token=turn.lease_token,
            replies=[(r.id, r.content()) for r in replies],
            source=turn.source,
            trajectory=turn.recorded(self.trajectory_logging),
            keep=agent.flag("BASIC_CAPABILITIES_KEEP_RESP"),
        )
        if state is None:
            log.info("turn taken over by a copy of its message", agent_id=str(agent.id), turn_id=str(turn.id))
            return "duplicate"
        if state == "superseded":
            self.metrics.superseded.inc()
            log.info("reply discarded: a newer message arrived", agent_id=str(agent.id), turn_id=str(turn.id))
            return "superseded"
        earlier = [
            Reply.from_content(r.id, r.content, channel_id=turn.message.proto.channel_id)
            for r in turn.ingested.earlier_replies
        ]
        stored = await self.outbox.publish_turn(agent.id, turn.room_id, replies, earlier)
        if stored:
            self.metrics.earlier_published.inc(stored)
            log.info("published a room's earlier replies first", turn_id=str(turn.id), replies=stored)
        for reply in replies:
            await self.events.emit(agent, "MESSAGE_SENT", turn.id, turn.room_id, response_id=str(reply.id))
        await self._end_stream(turn, replies[0])
        return "replied"

    async def _end_stream(self, turn: Turn, first: Reply) -> None:
        """The stream's final chunk: the rest of the first reply's text, when what was streamed is
        its beginning (else ``revised``: the durable reply is what counts)."""
        stream = turn.stream
        if stream is None or first.id != stream.response_id:
            return
        if first.text.startswith(stream.text):
            await stream.close(COMPLETED, first.text[len(stream.text) :])
        else:
            log.warning("streamed text is not the reply's beginning", turn_id=str(turn.id))
            await stream.close(REVISED)
