"""What every model provider implements; the gateway adds the protection around it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol


@dataclass(frozen=True)
class ProviderRequest:
    model_type: str
    prompt: str
    system: str = ""
    segments: list[tuple[str, bool]] = field(default_factory=list)
    temperature: float | None = None
    max_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    grammar: str = ""


@dataclass(frozen=True)
class Completion:
    text: str
    input_tokens: int = 0
    output_tokens: int = 0
    cached_input_tokens: int = 0
    finish_reason: str = "stop"


@dataclass(frozen=True)
class Embeddings:
    vectors: list[list[float]]
    model: str
    input_tokens: int = 0

    @property
    def dimension(self) -> int:
        return len(self.vectors[0]) if self.vectors else 0


class Provider(Protocol):
    name: str
    model: str

    async def generate(self, request: ProviderRequest) -> Completion: ...


class Embedder(Protocol):
    name: str
    dimension: int

    async def embed(self, texts: list[str]) -> Embeddings: ...
