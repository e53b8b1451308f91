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
class Evaluator:
    name: str
    handler: Callable[[TurnContext], Awaitable[ActionResult | None]]
    description: str = ""
    validate: Validator | None = None


class Service(Protocol):
    """Something long-lived a plugin runs on every runtime replica (a poller, a cache, a client):
    started when the replica starts, stopped when it stops."""

    name: str

    async def start(self) -> None: ...
    async def stop(self) -> None: ...


@dataclass(frozen=True)
class Plugin:
    name: str
    description: str = ""
    actions: tuple[Action, ...] = ()
    providers: tuple[Provider, ...] = ()
    evaluators: tuple[Evaluator, ...] = ()
    services: tuple[Service, ...] = ()
