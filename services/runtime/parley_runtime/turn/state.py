"""A turn in progress: what it accumulates as its stages run, its settings and its metrics."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from parley_platform.consumer import Delivery
from parley_platform.metrics import LATENCY_BUCKETS

from ..agents.directory import AgentInfo
from ..records import Ingested
from ..sdk import Action, Content, TurnContext
from .inbound import Inbound
from .streaming import Abort, ReplyStream


@dataclass(frozen=True)
class TurnSettings:
    max_text_bytes: int
    max_deliver: int
    model_timeout: float
    history: int
    provider_timeout: float
    trajectory_logging: bool
    embed_messages: bool = True
    embedding_window: float = 0.0  # seconds the turns' embeddings gather before one call and statement


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
        self.first_chunk = Histogram(
            "parley_turn_first_chunk_seconds",
            "Inbound message taken to the first streamed text of its reply",
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.aborted = Counter(
            "parley_turns_aborted_total",
            "Running turns stopped (by a cancel or a newer message in the room)",
            ["outcome"],
            registry=registry,
        )
        self.providers_failed = Counter(
            "parley_providers_failed_total",
            "Providers that failed or timed out",
            ["provider"],
            registry=registry,
        )
        self.earlier_published = Counter(
            "parley_replies_published_for_order_total",
            "A room's earlier replies a turn put on the outbound stream before its own (their turn "
            "had not published them yet)",
            registry=registry,
        )
        self.autonomous = Counter(
            "parley_autonomous_turns_total", "Autonomous turns by outcome", ["outcome"], registry=registry
        )
        self.background = Gauge(
            "parley_turn_background_tasks",
            "Finished turns' after-reply work (embeddings, evaluators) still running on this replica",
            registry=registry,
        )


@dataclass(frozen=True)
class Proposal:
    """An action the turn planned that waits for a person's confirmation instead of running."""

    index: int  # the action's position in the turn's plan
    action: Action
    params: dict[str, Any]


@dataclass
class Turn:
    """Everything one turn accumulates; also what trajectory logging records."""

    agent: AgentInfo
    message: Inbound
    ctx: TurnContext
    lease_token: int
    ingested: Ingested
    delivery: Delivery | None = None
    replies: list[Content] = field(default_factory=list)
    proposals: list[Proposal] = field(default_factory=list)
    trajectory: dict[str, Any] = field(default_factory=dict)
    raw_output: str = ""  # the model's last answer, as it came
    outcome: str | None = None  # set by the stage that decides it (deliver)
    abort: Abort = field(default_factory=Abort)  # a cancel or a newer message stops the turn
    stream: ReplyStream | None = None  # the first reply's text, published as it is generated
    gated: bool = False  # the gate answered instead of the agent (a pairing challenge): no evaluators

    @property
    def id(self) -> uuid.UUID:
        return self.message.turn_id

    @property
    def room_id(self) -> uuid.UUID:
        return self.message.room_id

    @property
    def source(self) -> str:
        return self.message.source

    def recorded(self, logging: bool) -> dict[str, Any] | None:
        """The trajectory as stored (secrets redacted), when trajectory logging is on."""
        return self.agent.redactor.redact_obj(self.trajectory) if logging else None
