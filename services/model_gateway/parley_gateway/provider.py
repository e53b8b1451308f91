"""What every model provider implements; the gateway adds the protection around it.

A provider turns a ``ProviderRequest`` into a ``Completion`` (or a stream of
text chunks ending in one), and an embedder turns texts into vectors. Failures
are raised as the errors below, each with its own stable code, so the
protection layer can tell what is worth a retry and what trips the breaker.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from parley_platform.errors import DeadlineExceeded, Internal, ParleyError, ResourceExhausted, Unavailable

from . import errors


@dataclass(frozen=True)
class Segment:
    content: str
    stable: bool


# The values built for every call (the request, its completion; the engine's ``Call`` and ``Result``)
# are slotted dataclasses, not frozen ones, and never changed once built: a frozen dataclass's
# ``__init__`` sets each field through ``object.__setattr__``, three times the cost, and the
# gateway builds five of them a call (docs/performance.md, eleventh round).
@dataclass(slots=True)
class ProviderRequest:
    model_type: str
    prompt: str
    system: str = ""
    segments: tuple[Segment, ...] = ()
    temperature: float | None = None
    max_tokens: int = 0
    stop: tuple[str, ...] = ()
    grammar: str = ""
    # Seconds the provider may spend on this call (the caller's remaining deadline).
    timeout: float = 60.0

    def bounded(self, *, max_tokens: int, timeout: float) -> ProviderRequest:
        """This request with its output budget and time limit. Built field by field: on the gateway's
        hot path ``dataclasses.replace`` cost more than the rest of the request's handling."""
        return ProviderRequest(
            model_type=self.model_type,
            prompt=self.prompt,
            system=self.system,
            segments=self.segments,
            temperature=self.temperature,
            max_tokens=max_tokens,
            stop=self.stop,
            grammar=self.grammar,
            timeout=timeout,
        )

    def estimated_input_tokens(self) -> int:
        """``estimate_tokens`` of the system text and the prompt together, without joining them: a
        prompt may be megabytes, and the join would copy it on every call."""
        return max(1, (len(self.system) + len(self.prompt) + 3) // 4)

    def ordered_segments(self) -> list[Segment]:
        """Stable segments first, then the rest, each group in its own order.

        Prefix caches (OpenAI, llama.cpp's KV cache) only reuse a shared prefix, so the
        parts that repeat across calls go first. A new list: the request is never mutated.
        """
        if not self.segments:
            return [Segment(self.prompt, stable=False)]
        return [s for s in self.segments if s.stable] + [s for s in self.segments if not s.stable]

    def ordered_prompt(self) -> str:
        return "".join(s.content for s in self.ordered_segments())


@dataclass(slots=True)
class Completion:
    text: str
    input_tokens: int = 0
    output_tokens: int = 0
    cached_input_tokens: int = 0
    finish_reason: str = "stop"


@dataclass(frozen=True)
class Chunk:
    """A piece of streamed text; the stream's last item is the whole ``Completion``."""

    text: str


@dataclass(frozen=True)
class Embeddings:
    vectors: list[list[float]]
    input_tokens: int = 0
    model: str = ""
    dimension: int = 0
    extra: dict[str, str] = field(default_factory=dict)


class Provider(Protocol):
    name: str

    def model_for(self, model_type: str) -> str: ...

    async def generate(self, request: ProviderRequest) -> Completion: ...

    def stream(self, request: ProviderRequest) -> AsyncIterator[Chunk | Completion]: ...

    async def close(self) -> None: ...


class Embedder(Protocol):
    name: str
    model: str
    dimension: int

    async def embed(self, texts: Sequence[str], *, timeout: float) -> Embeddings: ...

    async def close(self) -> None: ...


# --- provider failures ------------------------------------------------------------------------------
# Types callers catch. Each takes its code and retryability from its catalog entry, and that entry's
# hint unless the raise site knows better. The breaker counts only the provider's own failures.


class ProviderError(ParleyError):
    def __init__(self, message: str, *, hint: str | None = None) -> None:
        super().__init__(message, hint=errors.CATALOG[self.default_code].hint if hint is None else hint)


class ProviderRateLimited(ProviderError, ResourceExhausted):
    default_code = errors.PROVIDER_RATE_LIMITED.code
    retryable = errors.PROVIDER_RATE_LIMITED.is_retryable

    def __init__(self, message: str, *, retry_after: float | None = None, hint: str | None = None) -> None:
        super().__init__(message, hint=hint)
        self.retry_after = retry_after


class ProviderUnavailable(ProviderError, Unavailable):
    default_code = errors.PROVIDER_UNAVAILABLE.code
    retryable = errors.PROVIDER_UNAVAILABLE.is_retryable


class ProviderTimeout(ProviderError, DeadlineExceeded):
    default_code = errors.PROVIDER_TIMEOUT.code
    retryable = errors.PROVIDER_TIMEOUT.is_retryable


class ProviderBadResponse(ProviderError, Internal):
    """The provider answered, but not in its own protocol (malformed body, missing fields)."""

    default_code = errors.PROVIDER_BAD_RESPONSE.code
    retryable = errors.PROVIDER_BAD_RESPONSE.is_retryable


class ProviderRejected(ProviderError, Internal):
    """The provider refused the request itself (4xx other than 429): retrying cannot help."""

    default_code = errors.PROVIDER_REJECTED.code
    retryable = errors.PROVIDER_REJECTED.is_retryable


class ProviderAuthFailed(ProviderRejected):
    """The provider refused the gateway's key (401, 403)."""

    default_code = errors.PROVIDER_AUTH_FAILED.code


def estimate_tokens(text: str) -> int:
    """About four characters per token: for budgets and usage where the provider reports none."""
    return max(1, (len(text) + 3) // 4)
