"""The entry point of message turns: an inbound delivery becomes a turn and runs the pipeline.

decode (poison → dead letter) → ingest (one statement: the message stored once, the room's turn
lease with a fencing token, the room's history) → the stages → ack (by the consumer, after this
returns). Exactly-once delivery rests on three things: the inbound message is stored once (unique
per agent/source/external id), reply ids are derived from the inbound id (a republished reply is
deduplicated by JetStream), and the inbound message is acked only after the replies are durably
published.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Awaitable, Callable

from parley_platform.consumer import Delivery, Poison, is_permanent
from parley_platform.convert import uuid_or_none
from parley_platform.logging import get_logger
from parley_platform.outage import outage_of

from ..agents.directory import AgentDirectory, AgentInfo
from ..records import NewMessage
from ..roles import capped_claim, turn_role
from ..sdk import HistoryLine, Participant
from ..store import RuntimeStore
from .actions import ActionRunner
from .autonomous import autonomous_pipeline
from .capabilities import CapabilityGate
from .control import TurnControl
from .inbound import Inbound, decode_inbound, origin_of, parse_subject
from .pipeline import Pipeline, Stage
from .ports import Ports
from .reply import Reply
from .services import Resources, context
from .stages.act import Act
from .stages.after_reply import AfterReply, Background
from .stages.compose import Compose
from .stages.confirm import Confirm
from .stages.deliver import Deliver
from .stages.gate import Gate
from .stages.plan import Plan
from .stages.should_respond import ShouldRespond
from .state import Turn, TurnMetrics, TurnSettings
from .streaming import FAILED, FINAL_OUTCOMES, IGNORED, ReplyStream, Running, RunningTurns

log = get_logger(__name__)


class TurnProcessor:
    def __init__(
        self,
        *,
        resources: Resources,
        ports: Ports,
        directory: AgentDirectory,
        metrics: TurnMetrics,
        settings: TurnSettings,
        running: RunningTurns,
        control: TurnControl,
        catalogs: Callable[[uuid.UUID, int], Awaitable[object]],
    ) -> None:
        self.catalogs = catalogs  # brings an agent's catalog to a custom-action revision
        self.running = running
        self.control = control
        self.resources = resources
        self.store: RuntimeStore = resources.store
        self.ports = ports
        self.directory = directory
        self.metrics = metrics
        self.settings = settings
        self.background = Background()
        metrics.background.set_function(lambda: len(self.background))
        logging = settings.trajectory_logging
        runner = ActionRunner(
            store=self.store,
            model=ports.model,
            events=ports.events,
            metrics=metrics,
            capabilities=CapabilityGate(ports.authz),
        )
        stages: list[Stage] = [
            Gate(self.store, ports.pairing),
            ShouldRespond(self.store, ports.model, trajectory_logging=logging),
            Compose(metrics, timeout=settings.provider_timeout),
            Plan(
                ports.model,
                self.store,
                metrics,
                provider_timeout=settings.provider_timeout,
                trajectory_logging=logging,
            ),
            Act(runner),
            Confirm(self.store, ports.authz, ports.events),
            Deliver(self.store, ports.outbox, ports.events, metrics, trajectory_logging=logging),
            AfterReply(
                self.store,
                ports.model,
                self.background,
                embed_messages=settings.embed_messages,
                trajectory_logging=logging,
                embedding_window=settings.embedding_window,
            ),
        ]
        self.pipeline = Pipeline(stages, metrics, record=logging)
        self.autonomous = autonomous_pipeline(stages, metrics, record=logging)

    async def handle(self, delivery: Delivery) -> None:
        started = time.perf_counter()
        subject = parse_subject(delivery.subject)
        if subject.agent not in self.directory.agents and uuid_or_none(subject.agent) is not None:
            await self.directory.reload(subject.agent)  # created on another replica since we started
        try:
            proto, agent = decode_inbound(
                delivery.data,
                subject.agent,
                self.directory.agents,
                self.settings.max_text_bytes,
                subject_source=subject.source,
            )
        except Poison as poison:
            self.metrics.dead.labels(poison.label).inc()
            self.metrics.turns.labels("dead").inc()
            raise
        message = Inbound(proto, agent.id, origin=origin_of(subject, proto))
        try:
            outcome = await self._turn(delivery, message, agent, started)
        except Exception as exc:
            # An outage fails nothing: the consumer holds the message until the dependency is back.
            if outage_of(exc) is None and (
                delivery.num_delivered >= self.settings.max_deliver or is_permanent(exc)
            ):
                await self.store.finish_turn(
                    agent.id, message.turn_id, "failed", lease_token=None, error=str(exc)[:500]
                )
                self.metrics.turns.labels("failed").inc()
            raise
        self.metrics.turns.labels(outcome).inc()
        self.metrics.duration.observe(time.perf_counter() - started)

    async def exhausted(self, subject: str, data: bytes, sequence: int) -> None:
        """Every allowed delivery of this message died with its runtime (the consumer has
        dead-lettered it): its turn is failed, not left running."""
        parsed = parse_subject(subject)
        try:
            proto, agent = decode_inbound(
                data,
                parsed.agent,
                self.directory.agents,
                self.settings.max_text_bytes,
                subject_source=parsed.source,
            )
        except Poison:
            return  # never became a turn
        turn_id = Inbound(proto, agent.id).turn_id
        error = f"max_deliver ({self.settings.max_deliver}) reached: every delivery died unacknowledged"
        if await self.store.finish_turn(agent.id, turn_id, "failed", lease_token=None, error=error):
            self.metrics.turns.labels("failed").inc()
            log.error(
                "turn failed: its message exhausted its deliveries",
                agent_id=str(agent.id),
                turn_id=str(turn_id),
            )

    async def _turn(self, delivery: Delivery, message: Inbound, agent: AgentInfo, taken: float) -> str:
        started = time.perf_counter()
        proto = message.proto
        ingested = await self.store.ingest(
            NewMessage(
                agent_id=agent.id,
                world_id=message.world_id,
                world_external_id=proto.world_id or None,
                source=message.source,
                entity_id=message.sender_id,
                entity_names=[message.sender_name],
                entity_metadata={
                    message.source: {
                        "id": proto.sender_id,
                        "name": proto.sender_name,
                        "userName": proto.sender_username,
                    }
                },
                room_id=message.room_id,
                channel_id=proto.channel_id,
                room_type=message.room_type,
                stream_epoch=delivery.stream_epoch,
                stream_seq=delivery.stream_sequence,
                memory_id=message.turn_id,
                content=message.content(),
                external_id=proto.message_id,
                history=self.settings.history,
                sender_role=capped_claim(agent, message.claimed_role),
                reply_to_id=message.reply_to_id,
                origin=message.origin.value,
            )
        )
        self.metrics.stage.labels("ingest").observe(time.perf_counter() - started)
        if ingested.state is None:
            if ingested.previous_state == "replied" and delivery.redelivered:
                # Redelivered after the replies were stored: they may not all have been published.
                # Publish them again under their ids; JetStream drops the ones it has.
                for stored in await self.store.list_replies(agent.id, message.turn_id):
                    reply = Reply.from_content(stored.id, stored.content, channel_id=message.proto.channel_id)
                    await self.ports.outbox.publish(agent.id, message.room_id, reply)
                return "republished"
            log.info(
                "duplicate message, turn already finished",
                agent_id=str(agent.id),
                turn_id=str(message.turn_id),
                state=ingested.previous_state,
            )
            return "duplicate"
        if ingested.state == "superseded":
            self.metrics.superseded.inc()
            return "superseded"
        if ingested.lease_token is None:
            log.info(
                "a copy of this message holds the turn", agent_id=str(agent.id), turn_id=str(message.turn_id)
            )
            return "duplicate"
        if ingested.custom_action_revision is not None:
            await self.catalogs(agent.id, ingested.custom_action_revision)
        ctx = context(
            self.resources,
            agent,
            message,
            role=turn_role(
                ingested.sender_role, ingested.sender_role_source, capped_claim(agent, message.claimed_role)
            ),
            history=[
                HistoryLine(
                    str(h.entity_id),
                    agent.character.name if h.entity_id == agent.id else str(h.name or "user"),
                    h.text,
                    str(h.created_at),
                )
                for h in ingested.history
            ],
            participants=[
                Participant(str(p.entity_id), list(p.names), p.role, p.state) for p in ingested.participants
            ],
            present={"facts": ingested.has_facts, "documents": ingested.has_documents},
            room_turn=ingested.lease_token,
        )
        if ingested.lease_token > 1:  # the room had turns before: an older one may still run
            await self.control.room_taken(agent.id, message.room_id, ingested.lease_token)
        turn = Turn(agent, message, ctx, ingested.lease_token, ingested, delivery)
        turn.stream = ReplyStream(
            self.ports.chunks,
            self.metrics.first_chunk,
            agent.id,
            turn.id,
            proto.source,
            proto.channel_id,
            proto.message_id,
            started=taken,
        )
        running = Running(
            agent.id,
            turn.id,
            turn.room_id,
            message.source,
            ingested.lease_token,
            keeps_replies=bool(agent.flag("BASIC_CAPABILITIES_KEEP_RESP")),
            abort=turn.abort,
        )
        events = self.ports.events
        await events.emit(agent, "RUN_STARTED", turn.id, turn.room_id, source=message.source)
        with self.running.track(running):
            try:
                outcome = await (self.autonomous if message.autonomous else self.pipeline).run(turn)
            except BaseException:
                await turn.stream.close(FAILED)
                raise
        if outcome != "duplicate":  # else the copy holding the turn streams its reply
            await turn.stream.close(FINAL_OUTCOMES.get(outcome, IGNORED))
        await events.emit(agent, "RUN_ENDED", turn.id, turn.room_id, status=outcome)
        return outcome

    async def drain(self, timeout: float) -> None:
        await self.background.drain(timeout)
