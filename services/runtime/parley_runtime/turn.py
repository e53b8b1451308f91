"""One agent turn, in the spec's order: ingest → lease → gates → should-respond →
compose state → model → parse → (provider re-ask) → actions → stale check →
deliver → ack → evaluators, with events along the way.

Exactly-once delivery rests on three things: the inbound message is stored
once (unique per agent/source/external id), reply ids are derived from the
inbound id (so a republished reply is deduplicated by JetStream), and the
inbound message is acked only after the replies are durably published.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from google.protobuf.message import DecodeError
from google.protobuf.timestamp_pb2 import Timestamp
from prometheus_client import CollectorRegistry, Counter, Histogram
from psycopg.types.json import Jsonb

from parley.v1 import model_pb2, runtime_pb2
from parley_clients.pairing import PairingGate, dm_policy
from parley_platform.bus import Bus
from parley_platform.consumer import Delivery, Poison, is_permanent
from parley_platform.errors import ParleyError
from parley_platform.logging import get_logger
from parley_platform.metrics import LATENCY_BUCKETS
from parley_platform.rpc import RpcClient

from . import ids
from .actions import describe, permission_error, resolve_action_args, schema_errors
from .agent_settings import setting_list
from .agents import AgentDirectory, AgentInfo
from .confirmations import Confirmations, Proposal, needs_confirmation
from .context import (
    HistoryLine,
    KnowledgeHit,
    MemoryHit,
    MessageView,
    Participant,
    PendingCall,
    State,
    TurnContext,
)
from .documents import DocumentStore, Requester
from .parser import ParsedResponse, normalize_actions, parse_or_plain, parse_response
from .plugin import Action, ActionResult, Callback, Content, Provider
from .prompt import Segment, build_turn_prompt, join_segments
from .store import Ingested, RuntimeStore

log = get_logger(__name__)

MAX_ID_CHARS = 256
MAX_METADATA_ENTRIES = 64
MAX_METADATA_VALUE = 4096
MAX_ATTACHMENTS = 32
SOURCE_PATTERN = re.compile(r"[A-Za-z0-9_-]{1,64}")
ROOM_TYPES = {value: name.removeprefix("ROOM_TYPE_") for name, value in runtime_pb2.RoomType.items()}
ROOM_TYPES[runtime_pb2.ROOM_TYPE_UNSPECIFIED] = "GROUP"
MODEL_TYPES = {
    (False, False): model_pb2.MODEL_TYPE_TEXT_LARGE,
    (False, True): model_pb2.MODEL_TYPE_TEXT_SMALL,
    (True, False): model_pb2.MODEL_TYPE_OBJECT_LARGE,
    (True, True): model_pb2.MODEL_TYPE_OBJECT_SMALL,
}
DM_ROOMS = frozenset({"DM", "VOICE_DM"})
ALWAYS_RESPOND_ROOMS = frozenset({"DM", "VOICE_DM", "SELF", "API"})
ROLES = frozenset({"OWNER", "ADMIN", "MEMBER", "GUEST", "NONE"})

SHOULD_RESPOND_PROMPT = """# Should {name} respond?
You are {name}. Decide whether to take part in this conversation. Answer RESPOND when the
message is for you or you have something useful to add, IGNORE when it is not for you,
STOP when you were asked to be quiet.

{conversation}
Answer with exactly:
<response><name>{name}</name><reasoning>one sentence</reasoning>
<action>RESPOND|IGNORE|STOP</action></response>
"""


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
        self.actions = Counter(
            "parley_actions_total", "Actions run", ["action", "outcome"], registry=registry
        )
        self.providers_failed = Counter(
            "parley_providers_failed_total",
            "Providers that failed or timed out",
            ["provider"],
            registry=registry,
        )


@dataclass(frozen=True)
class TurnSettings:
    max_text_bytes: int
    max_deliver: int
    model_timeout: float
    history: int
    provider_timeout: float
    trajectory_logging: bool
    embed_messages: bool = True


def decode_inbound(
    data: bytes, subject_agent: str, agents: Mapping[str, AgentInfo], max_text_bytes: int
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
    for name in (
        "message_id",
        "channel_id",
        "sender_id",
        "world_id",
        "in_reply_to",
        "sender_name",
        "sender_username",
    ):
        value = getattr(inbound, name)
        if len(value) > MAX_ID_CHARS:
            raise Poison(f"{name} is longer than {MAX_ID_CHARS} characters", label="too_large")
    if len(inbound.metadata) > MAX_METADATA_ENTRIES or any(
        len(k) > MAX_ID_CHARS or len(v) > MAX_METADATA_VALUE for k, v in inbound.metadata.items()
    ):
        raise Poison(
            f"metadata is limited to {MAX_METADATA_ENTRIES} entries, keys of {MAX_ID_CHARS} and values"
            f" of {MAX_METADATA_VALUE} characters",
            label="too_large",
        )
    if len(inbound.attachments) > MAX_ATTACHMENTS:
        raise Poison(f"at most {MAX_ATTACHMENTS} attachments", label="too_large")
    # PostgreSQL text cannot hold NUL: such a message could never be stored.
    for name, value in _strings(inbound):
        if "\x00" in value:
            raise Poison(f"{name} contains a NUL character", label="nul")
    role = inbound.metadata.get("sender_role", "")
    if role and role.upper() not in ROLES:
        raise Poison(f"metadata.sender_role must be one of {', '.join(sorted(ROLES))}", label="bad_role")
    return inbound, agent


def _strings(inbound: runtime_pb2.InboundMessage) -> list[tuple[str, str]]:
    found = [(f.name, getattr(inbound, f.name)) for f in inbound.DESCRIPTOR.fields if f.type == f.TYPE_STRING]
    found += [(f"metadata.{k}", f"{k}{v}") for k, v in inbound.metadata.items()]
    for index, a in enumerate(inbound.attachments):
        found += [(f"attachments[{index}].{f.name}", getattr(a, f.name)) for f in a.DESCRIPTOR.fields]
    return found


def _uuid_or_none(value: str) -> uuid.UUID | None:
    try:
        return uuid.UUID(value)
    except ValueError:
        return None


def _mute_active(state: Mapping[str, Any] | None, now: datetime) -> tuple[bool, bool]:
    """(muted now, a timed mute that has expired)."""
    if not state or state.get("state") != "MUTED":
        return False, False
    until = state.get("until")
    if until is None:
        return True, False
    until_at = until if isinstance(until, datetime) else datetime.fromisoformat(str(until))
    return (until_at > now, until_at <= now)


@dataclass
class Turn:
    """Everything one turn accumulates; also what trajectory logging records."""

    agent: AgentInfo
    inbound: runtime_pb2.InboundMessage
    delivery: Delivery
    turn_id: uuid.UUID
    room_id: uuid.UUID
    lease_token: int
    ctx: TurnContext
    replies: list[Content] = field(default_factory=list)
    trajectory: dict[str, Any] = field(default_factory=dict)
    proposals: list[Proposal] = field(default_factory=list)  # actions awaiting confirmation


class TurnServices:
    """``RuntimeServices`` for one turn: what handlers, providers and evaluators may ask for."""

    def __init__(
        self,
        processor: TurnProcessor,
        agent: AgentInfo,
        room_id: uuid.UUID,
        ctx_ref: list[TurnContext],
        source: str,
    ) -> None:
        self.p = processor
        self.agent = agent
        self.room_id = room_id
        self._ctx = ctx_ref
        self.source = source

    async def set_room_state(self, state: str | None, *, mute_until: datetime | None = None) -> None:
        await self.p.store.set_room_state(self.agent.id, self.room_id, state, mute_until)

    async def search_memories(self, text: str, *, kind: str = "facts", limit: int = 5) -> list[MemoryHit]:
        if not await self.p.store.has_memories(self.agent.id, kind):
            return []
        [vector] = await self.p.embed([text], self.agent.id)
        rows = await self.p.store.search_memories(self.agent.id, vector, kind=kind, limit=limit)
        return [
            MemoryHit(str(r["id"]), r["kind"], r["text"] or "", float(r["similarity"]), r["created_at"])
            for r in rows
        ]

    async def remember(self, kind: str, text: str, *, metadata: Mapping[str, Any] | None = None) -> uuid.UUID:
        memory_id = uuid.uuid5(self.agent.id, f"{kind}:{self.room_id}:{text}")
        [vector] = await self.p.embed([text], self.agent.id)
        ctx = self._ctx[0]
        await self.p.store.remember(
            agent_id=self.agent.id,
            memory_id=memory_id,
            kind=kind,
            text=text,
            room_id=self.room_id,
            entity_id=ctx.message.sender_id,
            source=self.source,
            embedding=vector,
            metadata=dict(metadata or {}),
        )
        return memory_id

    async def generate(self, prompt: str, *, small: bool = False, structured: bool = False) -> str:
        return await self.p.generate(
            self.agent, [Segment(prompt, stable=False)], small=small, structured=structured
        )

    def get_setting(self, key: str) -> object | None:
        return self.agent.setting(key)

    async def action_catalog(self) -> str:
        return describe(await self.agent.catalog.available(self._ctx[0]))

    async def search_documents(self, text: str, *, limit: int = 5) -> list[KnowledgeHit]:
        documents = DocumentStore(self.p.store.db)
        if not text.strip() or not await documents.has_documents(self.agent.id):
            return []
        [vector] = await self.p.embed([text], self.agent.id)
        # As the sender: the rules of their roles apply inside the search's SQL. In a room of one
        # person with the agent, that is everything they may read; in a shared room only the room's
        # global documents, so nothing private to one participant is quoted to the others.
        ctx = self._ctx[0]
        private = ctx.message.room_type in ALWAYS_RESPOND_ROOMS and not ctx.is_autonomous
        found = await documents.search(
            self.agent.id,
            Requester(ctx.message.sender_id),
            vector,
            limit,
            room_id=None if private else self.room_id,
            scopes=None if private else ("global",),
        )
        return [KnowledgeHit(str(f.document_id), f.title, f.position, f.text, f.similarity) for f in found]

    async def pending_confirmations(self) -> list[PendingCall]:
        return await self.p.confirmations.pending(self.agent, self.room_id)

    async def decide_confirmation(self, tool_call_id: str, *, approve: bool, reason: str = "") -> str:
        ctx = self._ctx[0]
        return await self.p.confirmations.decide(
            self.agent, tool_call_id, approve=approve, reason=reason, decided_by=str(ctx.message.sender_id)
        )


class TurnProcessor:
    def __init__(
        self,
        *,
        store: RuntimeStore,
        bus: Bus,
        rpc: RpcClient,
        directory: AgentDirectory,
        metrics: TurnMetrics,
        settings: TurnSettings,
    ) -> None:
        self.store = store
        self.bus = bus
        self.rpc = rpc
        self.directory = directory
        self.pairing = PairingGate(rpc)
        self.metrics = metrics
        self.settings = settings
        self.confirmations = Confirmations(self)
        self._background: set[asyncio.Task[None]] = set()

    # -- model gateway -------------------------------------------------------------------------

    async def generate(
        self, agent: AgentInfo, segments: Sequence[Segment], *, small: bool = False, structured: bool = False
    ) -> str:
        request = model_pb2.GenerateRequest(
            agent_id=str(agent.id),
            model_type=MODEL_TYPES[(structured, small)],
            prompt=join_segments(segments),
            segments=[model_pb2.PromptSegment(content=s.content, stable=s.stable) for s in segments],
        )
        reply = await self.rpc.call(
            "model", "Generate", request, model_pb2.GenerateResponse, timeout=self.settings.model_timeout
        )
        return reply.text

    async def embed(self, texts: Sequence[str], agent_id: uuid.UUID) -> list[list[float]]:
        reply = await self.rpc.call(
            "model",
            "Embed",
            model_pb2.EmbedRequest(agent_id=str(agent_id), texts=texts),
            model_pb2.EmbedResponse,
            timeout=self.settings.model_timeout,
        )
        return [list(e.values) for e in reply.embeddings]

    # -- events --------------------------------------------------------------------------------

    async def emit(
        self, agent: AgentInfo, event_type: str, turn: uuid.UUID, room: uuid.UUID, **attributes: str
    ) -> None:
        """Events go to the EVENTS stream without waiting for its ack: they must never slow a turn."""
        event = runtime_pb2.Event(
            id=str(uuid.uuid4()),
            type=event_type,
            agent_id=str(agent.id),
            room_id=str(room),
            turn_id=str(turn),
            attributes=agent.redactor.redact_obj(attributes),
        )
        event.at.GetCurrentTime()
        with contextlib.suppress(ParleyError):
            await self.bus.publish_core(
                self.bus.subjects.events(str(agent.id), event_type), event.SerializeToString()
            )

    # -- the turn ------------------------------------------------------------------------------

    async def handle(self, delivery: Delivery) -> None:
        started = time.perf_counter()
        subject_agent = delivery.subject.rsplit(".", 1)[-1]
        if subject_agent not in self.directory.agents and _uuid_or_none(subject_agent) is not None:
            await self.directory.reload(subject_agent)  # created on another replica since we started
        try:
            inbound, agent = decode_inbound(
                delivery.data, subject_agent, self.directory.agents, self.settings.max_text_bytes
            )
        except Poison as poison:
            self.metrics.dead.labels(poison.label).inc()
            self.metrics.turns.labels("dead").inc()
            raise
        turn_id = ids.message_id(agent.id, inbound.source, inbound.message_id)
        try:
            outcome = await self._turn(delivery, inbound, agent, turn_id)
        except Exception as exc:
            if delivery.num_delivered >= self.settings.max_deliver or is_permanent(exc):
                await self.store.finish_turn(
                    agent.id, turn_id, "failed", lease_token=None, error=str(exc)[:500]
                )
                self.metrics.turns.labels("failed").inc()
            raise
        self.metrics.turns.labels(outcome).inc()
        self.metrics.duration.observe(time.perf_counter() - started)

    async def exhausted(self, subject: str, data: bytes, sequence: int) -> None:
        """Every allowed delivery of this message died with its runtime (the consumer has
        dead-lettered it): its turn is failed, not left running."""
        try:
            inbound, agent = decode_inbound(
                data, subject.rsplit(".", 1)[-1], self.directory.agents, self.settings.max_text_bytes
            )
        except Poison:
            return  # never became a turn
        turn_id = ids.message_id(agent.id, inbound.source, inbound.message_id)
        error = f"max_deliver ({self.settings.max_deliver}) reached: every delivery died unacknowledged"
        if await self.store.finish_turn(agent.id, turn_id, "failed", lease_token=None, error=error):
            self.metrics.turns.labels("failed").inc()
            log.error(
                "turn failed: its message exhausted its deliveries",
                agent_id=str(agent.id),
                turn_id=str(turn_id),
            )

    async def _turn(
        self, delivery: Delivery, inbound: runtime_pb2.InboundMessage, agent: AgentInfo, turn_id: uuid.UUID
    ) -> str:
        source = inbound.source
        room_id = ids.room_id(agent.id, source, inbound.channel_id)
        # A connector marks the agent's own messages by using the agent's id as the sender id.
        from_self = inbound.sender_id == str(agent.id)
        entity_id = agent.id if from_self else ids.entity_id(agent.id, source, inbound.sender_id)
        world = ids.world_id(agent.id, source, inbound.world_id) if inbound.world_id else None
        sender_name = inbound.sender_name or inbound.sender_username or inbound.sender_id
        role = inbound.metadata.get("sender_role", "").upper() or None
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
                "stream_epoch": delivery.stream_epoch,
                "stream_seq": delivery.stream_sequence,
                "memory_id": turn_id,
                "content": Jsonb(content),
                "external_id": inbound.message_id,
                "history": self.settings.history,
                "sender_role": role,
                "reply_to_id": _uuid_or_none(inbound.in_reply_to),
            }
        )
        self.metrics.stage.labels("ingest").observe(time.perf_counter() - t0)

        if ingested.state is None:
            if ingested.previous_state == "replied" and delivery.num_delivered > 1:
                # Redelivered after the replies were stored: they may not all have been published.
                # Publish them again under their ids; JetStream drops the ones it has.
                for row in await self.store.list_replies(agent.id, turn_id):
                    await self.publish_reply(inbound, agent, room_id, row["id"], row["content"])
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

        ctx = self.context(
            agent,
            inbound,
            turn_id,
            role=ingested.sender_role or role or "MEMBER",
            history=[
                HistoryLine(
                    str(h["entity_id"]), self._speaker(agent, h), h["text"] or "", str(h["created_at"])
                )
                for h in ingested.history
            ],
            participants=[
                Participant(str(p["entity_id"]), p["names"] or [], p["role"], p["user_state"])
                for p in ingested.participants
            ],
        )
        turn = Turn(agent, inbound, delivery, turn_id, room_id, ingested.lease_token, ctx)
        await self.emit(agent, "RUN_STARTED", turn_id, room_id, source=source)

        outcome = await self._run(turn, ingested)
        await self.emit(agent, "RUN_ENDED", turn_id, room_id, status=outcome)
        return outcome

    def context(
        self,
        agent: AgentInfo,
        inbound: runtime_pb2.InboundMessage,
        turn_id: uuid.UUID,
        *,
        role: str,
        history: Sequence[HistoryLine] = (),
        participants: Sequence[Participant] = (),
    ) -> TurnContext:
        """What handlers see of the turn of ``inbound``; also rebuilt to run a confirmed action."""
        source = inbound.source
        room_id = ids.room_id(agent.id, source, inbound.channel_id)
        from_self = inbound.sender_id == str(agent.id)
        ctx_ref: list[TurnContext] = []
        message = MessageView(
            id=turn_id,
            text=inbound.text,
            source=source,
            channel_id=inbound.channel_id,
            room_id=room_id,
            room_type=ROOM_TYPES.get(inbound.room_type, "GROUP"),
            sender_id=agent.id if from_self else ids.entity_id(agent.id, source, inbound.sender_id),
            sender_name=inbound.sender_name or inbound.sender_username or inbound.sender_id,
            world_id=ids.world_id(agent.id, source, inbound.world_id) if inbound.world_id else None,
            in_reply_to=inbound.in_reply_to,
            attachments=[
                {"id": a.id, "url": a.url, "title": a.title, "contentType": a.content_type, "text": a.text}
                for a in inbound.attachments
            ],
            metadata=dict(inbound.metadata),
        )
        ctx = TurnContext(
            agent_id=agent.id,
            character=agent.character,
            message=message,
            role=role,
            history=history,
            participants=participants,
            services=TurnServices(self, agent, room_id, ctx_ref, source),
        )
        ctx_ref.append(ctx)
        return ctx

    async def _run(self, turn: Turn, ingested: Ingested) -> str:
        agent, ctx = turn.agent, turn.ctx
        gate = await self._gate(turn, ingested)
        if gate is not None:
            if turn.replies:  # the pairing challenge: said instead of a turn, no model call
                return await self._deliver(turn)
            await self.store.finish_turn(
                agent.id, turn.turn_id, "ignored", lease_token=turn.lease_token, reason=gate
            )
            return "ignored"

        t0 = time.perf_counter()
        respond, why = await self._should_respond(turn, ingested)
        self.metrics.stage.labels("should_respond").observe(time.perf_counter() - t0)
        if not respond:
            await self._save_ignore(turn, why)
            return "ignored"

        t0 = time.perf_counter()
        ctx.state = await self._compose([p for p in agent.catalog.providers if not p.dynamic], ctx)
        self.metrics.stage.labels("compose").observe(time.perf_counter() - t0)

        t0 = time.perf_counter()
        parsed, raw = await self._plan(turn)
        if parsed.providers:
            wanted = [p for name in parsed.providers if (p := agent.catalog.provider(name)) is not None]
            if wanted:
                extra = await self._compose(wanted, ctx)
                ctx.state.texts.update(extra.texts)
                ctx.state.values.update(extra.values)
                ctx.state.data.update(extra.data)
                turn.trajectory["re_ask"] = {
                    "providers": [p.name for p in wanted],
                    "first_output": raw[:4000],
                }
                parsed, raw = await self._plan(turn)
        self.metrics.stage.labels("model").observe(time.perf_counter() - t0)
        ctx.parsed = parsed

        t0 = time.perf_counter()
        actions = normalize_actions(parsed)
        if parsed.text.strip() and not any(agent.catalog.find(name) for name in actions):
            # The model answered but named no action it has (small models invent some): the text is
            # still its answer. The unknown names are recorded as unknown, and nothing runs for them.
            actions = [*actions, "REPLY"]
        turn.trajectory["actions"] = []
        for index, name in enumerate(actions):
            await self._run_action(turn, index, name)
        if turn.proposals:
            # Asked for, not run: a pending decision each, one prompt, and the turn ends here.
            turn.replies.append(await self.confirmations.propose(turn))
        self.metrics.stage.labels("actions").observe(time.perf_counter() - t0)

        t0 = time.perf_counter()
        outcome = await self._deliver(turn)
        self.metrics.stage.labels("deliver").observe(time.perf_counter() - t0)
        if outcome in ("replied", "ignored"):
            self._spawn(self._after_reply(turn))
        return outcome

    # -- gates and should-respond -------------------------------------------------------------

    async def _gate(self, turn: Turn, ingested: Ingested) -> str | None:
        agent, ctx = turn.agent, turn.ctx
        if not agent.enabled:
            return "disabled"
        if ctx.message.sender_id == agent.id and not ctx.is_autonomous:
            return "self"
        if ctx.message.room_type in DM_ROOMS and not ctx.is_autonomous:
            policy = dm_policy(
                agent.setting(f"DM_POLICY_{ctx.message.source.upper()}")
                or agent.setting("DM_POLICY")
                or "open",
                "DM_POLICY",
            )
            admission = await self.pairing.admit(
                agent_id=str(agent.id),
                channel=ctx.message.source,
                sender_id=turn.inbound.sender_id,
                policy=policy,
                agent_name=agent.character.name,
                metadata={"sender_name": ctx.message.sender_name},
            )
            turn.trajectory["admission"] = {"policy": policy.value, "reason": admission.reason}
            if not admission.serve:
                if admission.reply:
                    turn.replies.append(Content(text=admission.reply, actions=("PAIRING",)))
                return f"pairing:{admission.reason}"
        now = datetime.now(UTC)
        muted, expired = _mute_active(ingested.agent_room_state, now)
        if expired:
            await self.store.lift_expired_mute(agent.id, turn.room_id)
        elif muted:
            return "muted"
        world = ingested.world_metadata or {}
        if world.get("agent_mute_state") == "MUTED":
            world_muted, world_expired = _mute_active(
                {"state": "MUTED", "until": world.get("agent_mute_until")}, now
            )
            if world_expired and ctx.message.world_id is not None:
                await self.store.lift_expired_world_mute(agent.id, ctx.message.world_id)
            elif world_muted:
                return "world_muted"
        return None

    async def _should_respond(self, turn: Turn, ingested: Ingested) -> tuple[bool, str]:
        agent, ctx = turn.agent, turn.ctx
        if ctx.is_autonomous:
            return True, "autonomous"
        if ctx.message.room_type in ALWAYS_RESPOND_ROOMS:
            return True, "room_type"
        if ctx.message.source in setting_list(agent.setting("ALWAYS_RESPOND_SOURCES")):
            return True, "always_respond_source"
        if ctx.message.room_type in {
            r.upper() for r in setting_list(agent.setting("ALWAYS_RESPOND_ROOM_TYPES"))
        }:
            return True, "always_respond_room_type"
        if turn.inbound.mentions_agent or ingested.replies_to_agent:
            return True, "addressed"
        if (ingested.agent_room_state or {}).get("state") == "FOLLOWED":
            return True, "followed"
        conversation = "".join(f"{h.name}: {h.text}\n" for h in ctx.history[-10:])
        conversation += f"{ctx.message.sender_name}: {ctx.message.text}\n"
        large = str(agent.setting("SHOULD_RESPOND_MODEL") or "small").lower() == "large"
        prompt = SHOULD_RESPOND_PROMPT.format(name=agent.character.name, conversation=conversation)
        answer = await self.generate(agent, [Segment(prompt, stable=False)], small=not large)
        parsed = parse_response(answer)
        decision = (parsed.fields.get("action", "") if parsed else "").strip().upper()
        turn.trajectory["should_respond"] = {"model": "large" if large else "small", "output": answer[:2000]}
        if decision == "RESPOND":
            return True, "model"
        return False, f"model:{decision.lower() or 'unparsable'}"

    async def _save_ignore(self, turn: Turn, reason: str) -> None:
        content = {
            "text": "",
            "actions": ["IGNORE"],
            "simple": True,
            "source": turn.inbound.source,
            "inReplyTo": turn.inbound.message_id,
            "reason": reason,
        }
        await self.store.save_ignore(
            agent_id=turn.agent.id,
            room_id=turn.room_id,
            turn_id=turn.turn_id,
            memory_id=ids.response_id(turn.turn_id),
            lease_token=turn.lease_token,
            content=content,
            source=turn.inbound.source,
            reason=reason,
            trajectory=self._trajectory(turn),
        )

    # -- state, prompt, plan -------------------------------------------------------------------

    async def _compose(self, providers: Sequence[Provider], ctx: TurnContext) -> State:
        """Run providers concurrently within one total timeout; a failing one is left out, never fatal."""
        state = State()
        if not providers:
            return state
        redactor = self.directory.agents[str(ctx.agent_id)].redactor
        tasks = {p.name: asyncio.ensure_future(p.get(ctx)) for p in providers}
        _, pending = await asyncio.wait(tasks.values(), timeout=self.settings.provider_timeout)
        for task in pending:
            task.cancel()
        for provider in providers:
            task = tasks[provider.name]
            if task in pending or task.cancelled() or task.exception() is not None:
                self.metrics.providers_failed.labels(provider.name).inc()
                error = "timed out" if task in pending else repr(task.exception())
                log.warning(
                    "provider failed",
                    provider=provider.name,
                    agent_id=str(ctx.agent_id),
                    error=redactor.redact(error),
                )
                continue
            result = task.result()
            if result.text:
                state.texts[provider.name] = result.text
            state.values.update(result.values)
            state.data[provider.name] = dict(result.data)
        return state

    async def _plan(self, turn: Turn) -> tuple[ParsedResponse, str]:
        agent, ctx = turn.agent, turn.ctx
        segments = build_turn_prompt(agent.character, ctx.state, ctx.message.sender_name, ctx.message.text)
        prompt = join_segments(segments)
        if prompt != "".join(s.content for s in segments):  # the invariant the gateway checks too
            raise AssertionError("prompt segments do not join to the prompt")
        raw = await self.generate(agent, segments)
        if self.settings.trajectory_logging:
            turn.trajectory["providers"] = dict(ctx.state.texts)
            turn.trajectory["segments"] = [{"stable": s.stable, "content": s.content} for s in segments]
        turn.trajectory["raw_output"] = raw[:16000]
        parsed = parse_or_plain(raw)
        turn.trajectory["parsed"] = {
            "actions": parsed.actions,
            "providers": parsed.providers,
            "thought": parsed.thought,
            "text": parsed.text,
        }
        return parsed, raw

    # -- actions -------------------------------------------------------------------------------

    async def _run_action(self, turn: Turn, index: int, name: str) -> None:
        agent, ctx = turn.agent, turn.ctx
        record: dict[str, Any] = {"index": index, "name": name}
        turn.trajectory["actions"].append(record)
        action = agent.catalog.find(name)
        if action is None:
            self._record(turn, record, "unknown", ActionResult(False, error=f"UNKNOWN_ACTION: {name}"))
            return
        record["name"] = action.name
        refusal = permission_error(action, ctx)
        if refusal is not None:
            self._record(turn, record, "rejected", ActionResult(False, error=refusal))
            return
        if action.validate is not None and not await action.validate(ctx):
            self._record(
                turn, record, "skipped", ActionResult(False, error=f"{action.name} is not valid here")
            )
            return
        planner = (ctx.parsed.action_params.get(action.name) if ctx.parsed else None) or {}
        resolution = await resolve_action_args(
            action,
            planner,
            extract=lambda prompt: self.generate(
                agent, [Segment(prompt, False)], small=True, structured=True
            ),
            intent=ctx.message.text,
            recent=[f"{h.name}: {h.text}" for h in ctx.history],
        )
        record["params"] = resolution.params
        if resolution.extraction_calls:
            record["extraction_calls"] = resolution.extraction_calls
        if resolution.missing:
            self._record(
                turn,
                record,
                "failed",
                ActionResult(False, error=f"missing: [{', '.join(resolution.missing)}]"),
            )
            return
        if resolution.clarification:
            turn.replies.append(Content(text=resolution.clarification, actions=(action.name,)))
            self._record(turn, record, "clarify", ActionResult(False, error="CLARIFICATION_NEEDED"))
            return
        errors = schema_errors(action, resolution.params)
        if errors:
            self._record(turn, record, "invalid", ActionResult(False, error="; ".join(errors)))
            return
        if needs_confirmation(agent, action) and not ctx.is_autonomous:
            turn.proposals.append(Proposal(index, action, dict(resolution.params)))
            self._record(
                turn, record, "pending", ActionResult(False, error="AWAITING_CONFIRMATION: asked the user")
            )
            return
        if not action.idempotent:
            claimed = await self.store.claim_effect(agent.id, turn.turn_id, index, action.name)
            if not claimed:
                existing = await self.store.get_effect(agent.id, turn.turn_id, index)
                if existing is not None and existing["result"] is not None:
                    self._record(turn, record, "replayed", ActionResult.from_json(existing["result"]))
                else:
                    self._record(
                        turn,
                        record,
                        "uncertain",
                        ActionResult(
                            False,
                            error="UNCERTAIN_EFFECT: a previous attempt started this action and did not "
                            "record a result; it is not run again",
                        ),
                    )
                return
        await self.emit(agent, "ACTION_STARTED", turn.turn_id, turn.room_id, action=action.name)

        async def callback(content: Content) -> None:
            turn.replies.append(content)

        result, outcome = await self.invoke(agent, action, ctx, resolution.params, callback)
        if not action.idempotent:
            await self.store.complete_effect(
                agent.id, turn.turn_id, index, agent.redactor.redact_obj(result.to_json())
            )
        self._record(turn, record, outcome, result)
        await self.emit(
            agent, "ACTION_COMPLETED", turn.turn_id, turn.room_id, action=action.name, outcome=outcome
        )

    async def invoke(
        self,
        agent: AgentInfo,
        action: Action,
        ctx: TurnContext,
        params: Mapping[str, Any],
        callback: Callback,
    ) -> tuple[ActionResult, str]:
        """Run a handler: its exception is a failed result (``error``), never a failed turn."""
        try:
            result = await action.handler(ctx, dict(params), callback) or ActionResult(True)
            return result, "success" if result.success else "failed"
        except Exception as exc:
            # No traceback: a handler's locals and messages may hold the agent's secrets.
            error = agent.redactor.redact(f"{type(exc).__name__}: {exc}")
            log.error("action handler raised", action=action.name, agent_id=str(agent.id), error=error)
            return ActionResult(False, error=error), "error"

    def _record(self, turn: Turn, record: dict[str, Any], outcome: str, result: ActionResult) -> None:
        record["outcome"] = outcome
        record["result"] = result.to_json()
        turn.ctx.results.append(result)
        self.metrics.actions.labels(
            record["name"] if turn.agent.catalog.find(record["name"]) else "unknown", outcome
        ).inc()

    # -- delivery ------------------------------------------------------------------------------

    async def _deliver(self, turn: Turn) -> str:
        agent = turn.agent
        if not turn.replies:
            await self.store.finish_turn(
                agent.id,
                turn.turn_id,
                "ignored",
                lease_token=turn.lease_token,
                reason="no_reply",
                trajectory=self._trajectory(turn),
            )
            return "ignored"
        replies = []
        for index, reply in enumerate(turn.replies):
            content = {
                "text": agent.redactor.redact(reply.text),
                "actions": list(reply.actions),
                "thought": agent.redactor.redact(reply.thought),
                "source": turn.inbound.source,
                "inReplyTo": turn.inbound.message_id,
            }
            if reply.target_channel:
                content["targetChannel"] = reply.target_channel
            replies.append((ids.response_id(turn.turn_id, index), content))
        keep = agent.flag("BASIC_CAPABILITIES_KEEP_RESP")
        state = await self.store.save_replies(
            agent_id=agent.id,
            room_id=turn.room_id,
            turn_id=turn.turn_id,
            lease_token=turn.lease_token,
            replies=replies,
            source=turn.inbound.source,
            trajectory=self._trajectory(turn),
            keep=keep,
        )
        if state is None:
            log.info(
                "turn taken over by a copy of its message", agent_id=str(agent.id), turn_id=str(turn.turn_id)
            )
            return "duplicate"
        if state == "superseded":
            self.metrics.superseded.inc()
            log.info(
                "reply discarded: a newer message arrived", agent_id=str(agent.id), turn_id=str(turn.turn_id)
            )
            return "superseded"
        for response_id, content in replies:
            await self.publish_reply(turn.inbound, agent, turn.room_id, response_id, content)
            await self.emit(agent, "MESSAGE_SENT", turn.turn_id, turn.room_id, response_id=str(response_id))
        return "replied"

    def _trajectory(self, turn: Turn) -> dict[str, Any] | None:
        if not self.settings.trajectory_logging:
            return None
        return turn.agent.redactor.redact_obj(turn.trajectory)

    async def publish_reply(
        self,
        inbound: runtime_pb2.InboundMessage,
        agent: AgentInfo,
        room_id: uuid.UUID,
        response_id: uuid.UUID,
        reply: Mapping[str, Any],
    ) -> None:
        created = Timestamp()
        created.GetCurrentTime()
        outbound = runtime_pb2.OutboundMessage(
            agent_id=str(agent.id),
            source=inbound.source,
            response_id=str(response_id),
            channel_id=reply.get("targetChannel") or inbound.channel_id,
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

    # -- after the reply -----------------------------------------------------------------------

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _after_reply(self, turn: Turn) -> None:
        """Embeddings and evaluators run after the reply was delivered; they never block or fail a turn."""
        if self.settings.embed_messages:
            await self._embed_messages(turn)
        if turn.agent.catalog.evaluators:
            await self._evaluate(turn)

    async def _embed_messages(self, turn: Turn) -> None:
        memories = [(turn.turn_id, turn.inbound.text)] + [
            (ids.response_id(turn.turn_id, i), r.text) for i, r in enumerate(turn.replies)
        ]
        memories = [(memory_id, text) for memory_id, text in memories if text.strip()]
        if not memories:
            return
        try:
            vectors = await self.embed([text for _, text in memories], turn.agent.id)
            for (memory_id, _), vector in zip(memories, vectors, strict=True):
                await self.store.set_embedding(turn.agent.id, memory_id, vector)
        except ParleyError as exc:
            log.warning(
                "message embeddings failed",
                agent_id=str(turn.agent.id),
                turn_id=str(turn.turn_id),
                error=str(exc),
            )

    async def _evaluate(self, turn: Turn) -> None:
        results = {}
        for evaluator in turn.agent.catalog.evaluators:
            try:
                if evaluator.validate is not None and not await evaluator.validate(turn.ctx):
                    continue
                result = await evaluator.handler(turn.ctx)
                results[evaluator.name] = result.to_json() if result else None
            except Exception as exc:
                log.warning(
                    "evaluator failed",
                    evaluator=evaluator.name,
                    agent_id=str(turn.agent.id),
                    error=turn.agent.redactor.redact(f"{type(exc).__name__}: {exc}"),
                )
                results[evaluator.name] = {"success": False, "error": f"{type(exc).__name__}"}
        if self.settings.trajectory_logging and results:
            with contextlib.suppress(ParleyError):
                await self.store.add_trajectory(
                    turn.agent.id, turn.turn_id, turn.agent.redactor.redact_obj({"evaluators": results})
                )

    async def drain(self, timeout: float) -> None:
        if self._background:
            await asyncio.wait(set(self._background), timeout=timeout)

    @staticmethod
    def _speaker(agent: AgentInfo, row: Mapping[str, Any]) -> str:
        if row["entity_id"] == str(agent.id):
            return agent.character.name
        return str(row["name"] or "user")
