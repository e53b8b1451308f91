"""One agent turn: ingest → lease → prompt → model → parse → deliver → ack.

Exactly-once delivery rests on three things: the inbound message is stored
once (unique per agent/source/external id), the reply id is derived from the
inbound id (so a republished reply is deduplicated by JetStream), and the
inbound message is acked only after the reply is durably published.
"""

from __future__ import annotations

import re
import time
import uuid
from dataclasses import dataclass
from typing import Any

from google.protobuf.message import DecodeError
from google.protobuf.timestamp_pb2 import Timestamp
from prometheus_client import CollectorRegistry, Counter, Histogram
from psycopg.types.json import Jsonb

from parley.v1 import model_pb2, runtime_pb2
from parley_platform.bus import Bus
from parley_platform.consumer import Delivery, Poison, is_permanent
from parley_platform.logging import get_logger
from parley_platform.metrics import LATENCY_BUCKETS
from parley_platform.rpc import RpcClient

from . import ids
from .character import Character
from .parser import normalize_actions, parse_or_plain
from .prompt import Line, build_turn_prompt, join_segments
from .store import RuntimeStore

log = get_logger(__name__)

SOURCE_PATTERN = re.compile(r"[A-Za-z0-9_-]{1,64}")
ROOM_TYPES = {value: name.removeprefix("ROOM_TYPE_") for name, value in runtime_pb2.RoomType.items()}
ROOM_TYPES[runtime_pb2.ROOM_TYPE_UNSPECIFIED] = "GROUP"


@dataclass(frozen=True)
class AgentInfo:
    id: uuid.UUID
    character: Character


class TurnMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.turns = Counter("parley_turns_total", "Turns by outcome", ["outcome"], registry=registry)
        self.duration = Histogram(
            "parley_turn_duration_seconds",
            "Inbound message to ack",
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.stage = Histogram(
            "parley_turn_stage_duration_seconds",
            "Time per turn stage",
            ["stage"],
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.dead = Counter(
            "parley_inbound_dead_total", "Inbound messages dead-lettered", ["reason"], registry=registry
        )
        self.superseded = Counter(
            "parley_turns_superseded_total", "Turns superseded by a newer message", registry=registry
        )


def decode_inbound(
    data: bytes, subject_agent: str, agents: dict[str, AgentInfo], max_text_bytes: int
) -> tuple[runtime_pb2.InboundMessage, AgentInfo]:
    """Decode and validate an inbound payload; raises ``Poison`` with the reason."""
    try:
        inbound = runtime_pb2.InboundMessage.FromString(data)
    except DecodeError as exc:
        raise Poison("payload is not a valid parley.v1.InboundMessage", label="undecodable") from exc
    if not inbound.agent_id:
        inbound.agent_id = subject_agent
    if inbound.agent_id != subject_agent:
        raise Poison(f"agent_id {inbound.agent_id[:64]!r} does not match the subject's agent", label="agent")
    agent = agents.get(inbound.agent_id)
    if agent is None:
        raise Poison(f"unknown agent {inbound.agent_id[:64]!r}", label="unknown_agent")
    if not inbound.source.strip():
        raise Poison("source is required (the connector's name)", label="no_source")
    if not SOURCE_PATTERN.fullmatch(inbound.source):
        raise Poison("source must be 1-64 letters, digits, '_' or '-'", label="bad_source")
    if not inbound.message_id.strip():
        raise Poison("message_id is required (the connector's id for the message)", label="no_message_id")
    if not inbound.channel_id.strip():
        raise Poison("channel_id is required (the connector's id for the room)", label="no_channel")
    if not inbound.sender_id.strip():
        raise Poison("sender_id is required (the connector's id for the sender)", label="no_sender")
    size = len(inbound.text.encode())
    if size > max_text_bytes:
        raise Poison(f"text is {size} bytes, over the limit of {max_text_bytes}", label="too_large")
    return inbound, agent


class TurnProcessor:
    def __init__(
        self,
        *,
        store: RuntimeStore,
        bus: Bus,
        rpc: RpcClient,
        agents: dict[str, AgentInfo],
        metrics: TurnMetrics,
        max_text_bytes: int,
        max_deliver: int,
        model_timeout: float,
        recent_messages: int,
    ) -> None:
        self.store = store
        self.bus = bus
        self.rpc = rpc
        self.agents = agents
        self.metrics = metrics
        self.max_text_bytes = max_text_bytes
        self.max_deliver = max_deliver
        self.model_timeout = model_timeout
        self.recent_messages = recent_messages

    async def handle(self, delivery: Delivery) -> None:
        started = time.perf_counter()
        subject_agent = delivery.subject.rsplit(".", 1)[-1]
        try:
            inbound, agent = decode_inbound(delivery.data, subject_agent, self.agents, self.max_text_bytes)
        except Poison as poison:
            self.metrics.dead.labels(poison.label).inc()
            self.metrics.turns.labels("dead").inc()
            raise
        turn_id = ids.message_id(agent.id, inbound.source, inbound.message_id)
        try:
            outcome = await self._turn(delivery, inbound, agent, turn_id)
        except Exception as exc:
            if delivery.num_delivered >= self.max_deliver or is_permanent(exc):
                await self.store.finish_turn(
                    agent.id, turn_id, "failed", lease_token=None, error=str(exc)[:500]
                )
                self.metrics.turns.labels("failed").inc()
            raise
        self.metrics.turns.labels(outcome).inc()
        self.metrics.duration.observe(time.perf_counter() - started)

    async def _turn(
        self, delivery: Delivery, inbound: runtime_pb2.InboundMessage, agent: AgentInfo, turn_id: uuid.UUID
    ) -> str:
        source = inbound.source
        room_id = ids.room_id(agent.id, source, inbound.channel_id)
        entity_id = ids.entity_id(agent.id, source, inbound.sender_id)
        world = ids.world_id(agent.id, source, inbound.world_id) if inbound.world_id else None
        sender_name = inbound.sender_name or inbound.sender_username or inbound.sender_id
        content: dict[str, Any] = {"text": inbound.text, "source": source}
        if inbound.attachments:
            content["attachments"] = [
                {"id": a.id, "url": a.url, "title": a.title, "contentType": a.content_type, "text": a.text}
                for a in inbound.attachments
            ]
        if inbound.in_reply_to:
            content["inReplyTo"] = inbound.in_reply_to
        if inbound.metadata:
            content["metadata"] = dict(inbound.metadata)

        t0 = time.perf_counter()
        ingested = await self.store.ingest(
            {
                "agent_id": agent.id,
                "world_id": world,
                "world_external_id": inbound.world_id or None,
                "source": source,
                "entity_id": entity_id,
                "entity_names": [sender_name],
                "entity_metadata": Jsonb(
                    {
                        source: {
                            "id": inbound.sender_id,
                            "name": inbound.sender_name,
                            "userName": inbound.sender_username,
                        }
                    }
                ),
                "room_id": room_id,
                "channel_id": inbound.channel_id,
                "room_type": ROOM_TYPES.get(inbound.room_type, "GROUP"),
                "stream_seq": delivery.stream_sequence,
                "memory_id": turn_id,
                "content": Jsonb(content),
                "external_id": inbound.message_id,
                "history": self.recent_messages,
            }
        )
        self.metrics.stage.labels("ingest").observe(time.perf_counter() - t0)
        if ingested.state is None:
            if ingested.previous_state == "replied" and delivery.num_delivered > 1:
                # Redelivered after the reply was stored: it may not have been published. Publish
                # the stored reply again under its id; JetStream drops it if it was.
                assert ingested.previous_response_id is not None
                stored = await self.store.get_memory(agent.id, ingested.previous_response_id)
                if stored is not None:
                    await self._publish(
                        inbound, agent, room_id, ingested.previous_response_id, stored["content"]
                    )
                    return "republished"
            log.info(
                "duplicate message, turn already finished",
                agent_id=str(agent.id),
                turn_id=str(turn_id),
                state=ingested.previous_state,
            )
            return "duplicate"
        if ingested.state == "superseded":
            self.metrics.superseded.inc()
            return "superseded"
        if ingested.lease_token is None:
            log.info("a copy of this message holds the turn", agent_id=str(agent.id), turn_id=str(turn_id))
            return "duplicate"
        response_id = ids.response_id(turn_id)

        t0 = time.perf_counter()
        lines = [Line(self._speaker(agent, row), row["text"] or "") for row in ingested.history]
        segments = build_turn_prompt(agent.character, lines, Line(sender_name, inbound.text))
        request = model_pb2.GenerateRequest(
            agent_id=str(agent.id),
            model_type=model_pb2.MODEL_TYPE_TEXT_LARGE,
            prompt=join_segments(segments),
            segments=[model_pb2.PromptSegment(content=s.content, stable=s.stable) for s in segments],
        )
        self.metrics.stage.labels("compose").observe(time.perf_counter() - t0)

        t0 = time.perf_counter()
        generated = await self.rpc.call(
            "model", "Generate", request, model_pb2.GenerateResponse, timeout=self.model_timeout
        )
        self.metrics.stage.labels("model").observe(time.perf_counter() - t0)

        parsed = parse_or_plain(generated.text)
        actions = normalize_actions(parsed)
        trajectory = {
            "segments": [{"stable": s.stable, "chars": len(s.content)} for s in segments],
            "model": {"provider": generated.provider, "model": generated.model},
            "raw_output": generated.text[:4000],
            "actions": actions,
        }
        if actions == ["IGNORE"] or actions == ["STOP"] or not parsed.text.strip():
            await self.store.finish_turn(agent.id, turn_id, "ignored", lease_token=ingested.lease_token)
            return "ignored"

        reply = {
            "text": parsed.text,
            "actions": actions,
            "thought": parsed.thought,
            "source": source,
            "inReplyTo": inbound.message_id,
        }
        t0 = time.perf_counter()
        state = await self.store.save_reply(
            agent_id=agent.id,
            room_id=room_id,
            turn_id=turn_id,
            lease_token=ingested.lease_token,
            response_id=response_id,
            content=reply,
            source=source,
            trajectory=trajectory,
        )
        if state is None:
            log.info("turn taken over by a copy of its message", agent_id=str(agent.id), turn_id=str(turn_id))
            return "duplicate"
        if state == "superseded":
            self.metrics.superseded.inc()
            log.info("reply discarded: a newer message arrived", agent_id=str(agent.id), turn_id=str(turn_id))
            return "superseded"
        await self._publish(inbound, agent, room_id, response_id, reply)
        self.metrics.stage.labels("deliver").observe(time.perf_counter() - t0)
        return "replied"

    @staticmethod
    def _speaker(agent: AgentInfo, row: dict[str, Any]) -> str:
        if row["entity_id"] == str(agent.id):
            return agent.character.name
        return str(row["name"] or "user")

    async def _publish(
        self,
        inbound: runtime_pb2.InboundMessage,
        agent: AgentInfo,
        room_id: uuid.UUID,
        response_id: uuid.UUID,
        reply: dict[str, Any],
    ) -> None:
        created = Timestamp()
        created.GetCurrentTime()
        outbound = runtime_pb2.OutboundMessage(
            agent_id=str(agent.id),
            source=inbound.source,
            response_id=str(response_id),
            channel_id=inbound.channel_id,
            in_reply_to=inbound.message_id,
            text=reply.get("text", ""),
            actions=reply.get("actions", []),
            thought=reply.get("thought", ""),
            room_id=str(room_id),
            created_at=created,
        )
        await self.bus.publish(
            self.bus.subjects.outbound(str(agent.id), inbound.source),
            outbound.SerializeToString(),
            msg_id=str(response_id),
        )
