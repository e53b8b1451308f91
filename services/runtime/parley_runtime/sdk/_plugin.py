"""What a plugin is made of: actions (what an agent can do), providers (what it knows before
it answers), evaluators (what it learns after) and services (what runs beside its turns)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Protocol

from ._context import TurnContext


class Tag(StrEnum):
    """What the runtime must know about an action before it runs it."""

    # Safe to run twice: no effect claim is written, and a retried turn runs it again.
    IDEMPOTENT = "effect:idempotent"
    # A person confirms each call first (through authz); the turn that plans it only asks.
    CONFIRM = "confirm"
    # Defined by an operator as data (an http, shell or code handler), not by a plugin.
    CUSTOM = "custom"


@dataclass(frozen=True)
class Content:
    """Something the agent says. Without a target it goes to the room of the turn."""

    text: str
    actions: tuple[str, ...] = ()
    thought: str = ""
    target_channel: str = ""  # another channel of the same connector (SEND_MESSAGE)
    target_source: str = ""  # another connector (SEND_MESSAGE on an autonomous turn)
    attachments: tuple[Mapping[str, str], ...] = ()


@dataclass
class ActionResult:
    success: bool
    text: str = ""
    values: dict[str, Any] = field(default_factory=dict)
    data: dict[str, Any] = field(default_factory=dict)
    error: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "success": self.success,
            "text": self.text,
            "values": self.values,
            "data": self.data,
            "error": self.error,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ActionResult:
        return cls(
            bool(data.get("success")),
            str(data.get("text", "")),
            dict(data.get("values") or {}),
            dict(data.get("data") or {}),
            data.get("error"),
        )


@dataclass(frozen=True)
class ProviderResult:
    text: str = ""
    values: Mapping[str, Any] = field(default_factory=dict)
    data: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Parameter:
    name: str
    description: str = ""
    required: bool = False
    schema: Mapping[str, Any] = field(default_factory=lambda: {"type": "string"})
    aliases: tuple[str, ...] = ()


Callback = Callable[[Content], Awaitable[None]]
ActionHandler = Callable[[TurnContext, dict[str, Any], Callback], Awaitable[ActionResult | None]]
Validator = Callable[[TurnContext], Awaitable[bool]]


@dataclass(frozen=True)
class Capability:
    """What an action does through an account (mail.send/create, payments.transfer/create). Such an
    action runs only after authz's one-shot Authorize succeeds for its exact parameters, against
    the account snapshot the agent's settings name (``CAPABILITY_<NAME>_ACCOUNT`` and
    ``CAPABILITY_<NAME>_SNAPSHOT``, NAME upper-cased with ``.`` and ``-`` as ``_``)."""

    name: str  # e.g. mail.send
    operation: str  # e.g. create
    risk: str = "R1"  # the catalog risk, R0 (none) .. R3 (irreversible)


@dataclass(frozen=True)
class Action:
    name: str
    description: str
    handler: ActionHandler
    similes: tuple[str, ...] = ()
    parameters: tuple[Parameter, ...] = ()
    examples: tuple[str, ...] = ()
    tags: frozenset[Tag] = frozenset()
    capabilities: frozenset[str] = frozenset()  # what it touches (http, payments, ...), for policy
    private: bool = False  # only on autonomous turns
    roles: frozenset[str] | None = None  # participant roles allowed to trigger it; None: anyone
    validate: Validator | None = None
    allow_empty_arrays: frozenset[str] = frozenset()
    capability: Capability | None = None  # authorized once per run through authz

    @property
    def idempotent(self) -> bool:
        return Tag.IDEMPOTENT in self.tags

    @property
    def needs_confirmation(self) -> bool:
        return Tag.CONFIRM in self.tags


@dataclass(frozen=True)
class Provider:
    name: str
    get: Callable[[TurnContext], Awaitable[ProviderResult]]
    description: str = ""
    position: int = 0
    dynamic: bool = False  # only when the model asks for it
    private: bool = False  # never listed to the model


@dataclass(frozen=True)
class EvaluatorPrompt:
    """An evaluator's part of the turn's one batched model call (its prompt segment): the request,
    the answer's fields (each a string; name them, or ``name: description``), and what the
    evaluator receives in their place when the batcher could not get a valid answer."""

    prompt: str
    fields: tuple[str, ...]
    fallback: Mapping[str, str] = field(default_factory=dict)
    large: bool = False  # the large model (default: the small one)


@dataclass(frozen=True)
class Evaluator:
    """What an agent learns after a turn. With ``segment`` and ``apply``, the evaluator's question is
    one section of the turn's batched call (every such evaluator of the turn in one model call) and
    ``apply`` gets its fields; without them ``handler`` runs on its own (and may call the model)."""

    name: str
    handler: Callable[[TurnContext], Awaitable[ActionResult | None]]
    description: str = ""
    validate: Validator | None = None
    segment: Callable[[TurnContext], Awaitable[EvaluatorPrompt | None]] | None = None
    apply: Callable[[TurnContext, Mapping[str, str], bool], Awaitable[ActionResult | None]] | None = None

    @property
    def batched(self) -> bool:
        return self.segment is not None and self.apply is not None


@dataclass(frozen=True)
class ServiceRun:
    """What the runtime hands a service it starts."""

    replica: str  # this runtime process
    settings: Mapping[str, object]  # the plugin's validated settings (see ``Plugin.config``)
    # A singleton's lease grant, raised on every grant: pass it along to what the service guards
    # (a resource refuses a token lower than the highest it has seen). None for other services.
    fencing_token: int | None = None


class Service(Protocol):
    """Something long-lived a plugin runs beside its agents' turns (a poller, a cache, a client):
    started on every runtime replica, stopped when the replica stops. A service with
    ``singleton = True`` runs on exactly one replica at a time: the one holding its authz lease,
    which hands it over (to another replica, with a higher fencing token) when that one dies.
    An optional ``async def health(self) -> bool`` reports whether it is well; the runtime
    publishes each service's state (``parley_plugin_service_state``)."""

    name: str

    async def start(self, run: ServiceRun) -> None: ...
    async def stop(self) -> None: ...


@dataclass(frozen=True)
class Setting:
    """A setting a plugin declares: read with the agent's ``get_setting`` order (secrets,
    settings, host), checked against ``schema`` (a string is converted to the schema's number,
    integer or boolean type first), and handed to ``init`` and the plugin's services."""

    name: str
    description: str = ""
    required: bool = False
    default: object | None = None
    schema: Mapping[str, Any] = field(default_factory=lambda: {"type": "string"})


@dataclass(frozen=True)
class EventView:
    """One of the runtime's events (RUN_STARTED, ACTION_STARTED, ACTION_COMPLETED, MESSAGE_SENT,
    CONFIRMATION_REQUESTED, RUN_ENDED, ...), as a plugin's event handler sees it."""

    type: str
    agent_id: str
    room_id: str
    turn_id: str
    attributes: Mapping[str, str]


EventHandler = Callable[[EventView], Awaitable[None]]


@dataclass(frozen=True)
class Plugin:
    name: str
    description: str = ""
    actions: tuple[Action, ...] = ()
    providers: tuple[Provider, ...] = ()
    evaluators: tuple[Evaluator, ...] = ()
    services: tuple[Service, ...] = ()
    # The runtime's events this plugin handles (run in the background: never slowing a turn).
    events: Mapping[str, tuple[EventHandler, ...]] = field(default_factory=dict)
    # Its settings, validated for each agent that uses it; ``init`` is called with them once per
    # agent (and again when they change) on each replica, before the agent's first turn there.
    config: tuple[Setting, ...] = ()
    init: Callable[[Mapping[str, object]], Awaitable[None]] | None = None
    # Plugins (by name) loaded before this one: they come first in the agent's plugin order,
    # their init runs first and their services start first (and stop last).
    dependencies: tuple[str, ...] = ()
