"""The HTTP providers: ``openai`` (any OpenAI-compatible endpoint) and ``anthropic`` (Messages API).

httpx sits behind this module: its errors become the provider errors of
``provider.py`` (429 → rate limited with Retry-After, 5xx/529 → unavailable,
timeouts → timeout, a body that is not the protocol → bad response, other
4xx → rejected). Keys come from the gateway's settings and are never logged or
echoed in an error.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from .provider import (
    Chunk,
    Completion,
    Embeddings,
    ProviderAuthFailed,
    ProviderBadResponse,
    ProviderRateLimited,
    ProviderRejected,
    ProviderRequest,
    ProviderTimeout,
    ProviderUnavailable,
    Segment,
)

DEFAULT_MAX_TOKENS = 1024
MAX_RETRY_AFTER = 60.0
ANTHROPIC_VERSION = "2023-06-01"
# The Messages API allows at most four cache breakpoints per request.
MAX_CACHE_MARKERS = 4


def _retry_after(response: httpx.Response) -> float | None:
    raw = response.headers.get("retry-after")
    if raw is None:
        return None
    try:
        value = float(raw)
    except ValueError:
        return None
    return min(max(value, 0.0), MAX_RETRY_AFTER) if value == value else None


def _error_type(response: httpx.Response) -> str:
    """The provider's own error type, when the body has one; never the raw body."""
    try:
        body = response.json()
    except ValueError:
        return ""
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict):
        kind = error.get("type") or error.get("code") or ""
        return str(kind)[:64]
    return ""


def raise_for_status(provider: str, response: httpx.Response) -> None:
    status = response.status_code
    if status < 400:
        return
    kind = _error_type(response)
    detail = f"{provider} answered HTTP {status}" + (f" ({kind})" if kind else "")
    if status == 429:
        raise ProviderRateLimited(detail, retry_after=_retry_after(response))
    if status >= 500 or status == 408:
        raise ProviderUnavailable(detail)
    if status in (401, 403):
        raise ProviderAuthFailed(detail)
    raise ProviderRejected(detail)


def _translate(provider: str, exc: httpx.HTTPError, timeout: float) -> Exception:
    if isinstance(exc, httpx.TimeoutException):
        return ProviderTimeout(f"{provider} did not answer within {timeout:.1f}s")
    if isinstance(exc, httpx.RemoteProtocolError | httpx.DecodingError):
        return ProviderBadResponse(f"{provider} broke the HTTP protocol: {type(exc).__name__}")
    return ProviderUnavailable(
        f"cannot reach {provider}: {type(exc).__name__}", hint="is its base URL right?"
    )


def _json(provider: str, response: httpx.Response) -> dict[str, Any]:
    try:
        body = response.json()
    except ValueError:
        raise ProviderBadResponse(f"{provider} answered with a body that is not JSON") from None
    if not isinstance(body, dict):
        raise ProviderBadResponse(f"{provider} answered with JSON that is not an object")
    return body


async def sse_events(
    provider: str, response: httpx.Response
) -> AsyncIterator[tuple[str, dict[str, Any] | None]]:
    """Server-sent events as (event name, JSON data); ``[DONE]`` gives (event, None)."""
    event = ""
    data: list[str] = []
    async for line in response.aiter_lines():
        if line == "":
            if data:
                payload = "\n".join(data)
                if payload.strip() == "[DONE]":
                    yield event, None
                else:
                    try:
                        parsed = json.loads(payload)
                    except ValueError:
                        raise ProviderBadResponse(f"{provider} streamed an event that is not JSON") from None
                    if not isinstance(parsed, dict):
                        raise ProviderBadResponse(f"{provider} streamed an event that is not an object")
                    yield event, parsed
            event, data = "", []
        elif line.startswith(":"):
            continue
        elif line.startswith("event:"):
            event = line[6:].strip()
        elif line.startswith("data:"):
            data.append(line[5:].removeprefix(" "))


def _int(value: object) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0


@dataclass
class ModelNames:
    small: str
    large: str

    def for_type(self, model_type: str) -> str:
        return self.large if model_type.endswith("LARGE") else self.small


class OpenAIProvider:
    """Chat completions (stable segments first, for the prefix cache) and embeddings."""

    name = "openai"

    def __init__(
        self,
        *,
        base_url: str,
        api_key: str,
        models: ModelNames,
        embedding_model: str = "text-embedding-3-small",
        embedding_dimension: int = 1536,
    ) -> None:
        self.models = models
        self.model = models.large
        self.embedding_model = embedding_model
        self.dimension = embedding_dimension
        headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = httpx.AsyncClient(base_url=base_url.rstrip("/") + "/", headers=headers)

    def model_for(self, model_type: str) -> str:
        return self.models.for_type(model_type)

    def _body(self, request: ProviderRequest, stream: bool) -> dict[str, Any]:
        messages: list[dict[str, str]] = []
        if request.system:
            messages.append({"role": "system", "content": request.system})
        messages.append({"role": "user", "content": request.ordered_prompt()})
        body: dict[str, Any] = {
            "model": self.model_for(request.model_type),
            "messages": messages,
            "max_tokens": request.max_tokens or DEFAULT_MAX_TOKENS,
        }
        if request.temperature is not None:
            body["temperature"] = request.temperature
        if request.stop:
            body["stop"] = list(request.stop)
        if request.model_type.startswith("OBJECT"):
            body["response_format"] = {"type": "json_object"}
        if stream:
            body["stream"] = True
            body["stream_options"] = {"include_usage": True}
        return body

    @staticmethod
    def _usage(usage: object) -> tuple[int, int, int]:
        if not isinstance(usage, dict):
            return 0, 0, 0
        details = usage.get("prompt_tokens_details")
        cached = _int(details.get("cached_tokens")) if isinstance(details, dict) else 0
        return _int(usage.get("prompt_tokens")), _int(usage.get("completion_tokens")), cached

    async def generate(self, request: ProviderRequest) -> Completion:
        try:
            response = await self._client.post(
                "chat/completions", json=self._body(request, False), timeout=request.timeout
            )
        except httpx.HTTPError as exc:
            raise _translate(self.name, exc, request.timeout) from exc
        raise_for_status(self.name, response)
        body = _json(self.name, response)
        try:
            choice = body["choices"][0]
            text = choice["message"]["content"]
        except (KeyError, IndexError, TypeError):
            raise ProviderBadResponse("openai answered without choices[0].message.content") from None
        if not isinstance(text, str):
            raise ProviderBadResponse("openai answered with a non-text message content")
        prompt_tokens, completion_tokens, cached = self._usage(body.get("usage"))
        return Completion(
            text=text,
            input_tokens=prompt_tokens,
            output_tokens=completion_tokens,
            cached_input_tokens=cached,
            finish_reason=str(choice.get("finish_reason") or "stop"),
        )

    async def stream(self, request: ProviderRequest) -> AsyncIterator[Chunk | Completion]:
        pieces: list[str] = []
        finish = "stop"
        usage: tuple[int, int, int] = (0, 0, 0)
        try:
            async with self._client.stream(
                "POST", "chat/completions", json=self._body(request, True), timeout=request.timeout
            ) as response:
                if response.status_code >= 400:
                    await response.aread()
                    raise_for_status(self.name, response)
                async for _event, data in sse_events(self.name, response):
                    if data is None:
                        break
                    if data.get("usage"):
                        usage = self._usage(data["usage"])
                    choices = data.get("choices")
                    if not isinstance(choices, list):
                        raise ProviderBadResponse("openai streamed a chunk without choices")
                    for choice in choices:
                        delta = choice.get("delta") if isinstance(choice, dict) else None
                        piece = delta.get("content") if isinstance(delta, dict) else None
                        if isinstance(piece, str) and piece:
                            pieces.append(piece)
                            yield Chunk(piece)
                        if isinstance(choice, dict) and choice.get("finish_reason"):
                            finish = str(choice["finish_reason"])
        except httpx.HTTPError as exc:
            raise _translate(self.name, exc, request.timeout) from exc
        yield Completion(
            text="".join(pieces),
            input_tokens=usage[0],
            output_tokens=usage[1],
            cached_input_tokens=usage[2],
            finish_reason=finish,
        )

    async def embed(self, texts: Sequence[str], *, timeout: float) -> Embeddings:
        try:
            response = await self._client.post(
                "embeddings", json={"model": self.embedding_model, "input": list(texts)}, timeout=timeout
            )
        except httpx.HTTPError as exc:
            raise _translate(self.name, exc, timeout) from exc
        raise_for_status(self.name, response)
        body = _json(self.name, response)
        data = body.get("data")
        if not isinstance(data, list) or len(data) != len(texts):
            raise ProviderBadResponse("openai answered with a data list that does not match the input")
        vectors: list[list[float]] = [[] for _ in texts]
        for position, item in enumerate(data):
            index = item.get("index", position) if isinstance(item, dict) else None
            vector = item.get("embedding") if isinstance(item, dict) else None
            if not isinstance(index, int) or not 0 <= index < len(texts) or not isinstance(vector, list):
                raise ProviderBadResponse("openai answered with a malformed embedding")
            if len(vector) != self.dimension or not all(isinstance(v, int | float) for v in vector):
                raise ProviderBadResponse(
                    f"openai answered with {len(vector)}-dimensional vectors, expected {self.dimension}",
                    hint="set PARLEY_OPENAI_EMBEDDING_DIMENSION to the model's dimension",
                )
            vectors[index] = [float(v) for v in vector]
        usage = body.get("usage")
        tokens = _int(usage.get("prompt_tokens")) if isinstance(usage, dict) else 0
        return Embeddings(
            vectors=vectors, input_tokens=tokens, model=self.embedding_model, dimension=self.dimension
        )

    async def close(self) -> None:
        await self._client.aclose()


class OpenAIEmbedder:
    """The ``openai`` provider's embeddings under the embedder interface."""

    def __init__(self, provider: OpenAIProvider) -> None:
        self.provider = provider
        self.name = provider.name
        self.model = provider.embedding_model
        self.dimension = provider.dimension

    async def embed(self, texts: Sequence[str], *, timeout: float) -> Embeddings:
        return await self.provider.embed(texts, timeout=timeout)

    async def close(self) -> None:
        return None


def anthropic_blocks(segments: Sequence[Segment]) -> list[dict[str, Any]]:
    """Text blocks in the caller's order, a cache marker closing each run of stable segments.

    A marker caches the whole prefix up to it, so one at the end of a stable run covers the run.
    """
    blocks: list[dict[str, Any]] = []
    markers = 0
    for index, segment in enumerate(segments):
        if not segment.content:
            continue
        block: dict[str, Any] = {"type": "text", "text": segment.content}
        ends_run = segment.stable and (index + 1 == len(segments) or not segments[index + 1].stable)
        if ends_run and markers < MAX_CACHE_MARKERS - 1:
            block["cache_control"] = {"type": "ephemeral"}
            markers += 1
        blocks.append(block)
    return blocks


class AnthropicProvider:
    name = "anthropic"

    def __init__(self, *, base_url: str, api_key: str, models: ModelNames) -> None:
        self.models = models
        self.model = models.large
        headers = {"anthropic-version": ANTHROPIC_VERSION}
        if api_key:
            headers["x-api-key"] = api_key
        self._client = httpx.AsyncClient(base_url=base_url.rstrip("/") + "/", headers=headers)

    def model_for(self, model_type: str) -> str:
        return self.models.for_type(model_type)

    def _body(self, request: ProviderRequest, stream: bool) -> dict[str, Any]:
        segments = list(request.segments) or [Segment(request.prompt, stable=False)]
        body: dict[str, Any] = {
            "model": self.model_for(request.model_type),
            "max_tokens": request.max_tokens or DEFAULT_MAX_TOKENS,
            "messages": [{"role": "user", "content": anthropic_blocks(segments)}],
        }
        if request.system:
            # The system prompt is the most stable part of all: cached too.
            body["system"] = [
                {"type": "text", "text": request.system, "cache_control": {"type": "ephemeral"}}
            ]
        if request.temperature is not None:
            body["temperature"] = min(request.temperature, 1.0)
        if request.stop:
            body["stop_sequences"] = list(request.stop)
        if stream:
            body["stream"] = True
        return body

    @staticmethod
    def _usage(usage: object) -> tuple[int, int, int]:
        if not isinstance(usage, dict):
            return 0, 0, 0
        read = _int(usage.get("cache_read_input_tokens"))
        created = _int(usage.get("cache_creation_input_tokens"))
        # The API's input_tokens counts only what was neither read from nor written to the cache.
        return _int(usage.get("input_tokens")) + read + created, _int(usage.get("output_tokens")), read

    async def generate(self, request: ProviderRequest) -> Completion:
        try:
            response = await self._client.post(
                "v1/messages", json=self._body(request, False), timeout=request.timeout
            )
        except httpx.HTTPError as exc:
            raise _translate(self.name, exc, request.timeout) from exc
        raise_for_status(self.name, response)
        body = _json(self.name, response)
        content = body.get("content")
        if not isinstance(content, list):
            raise ProviderBadResponse("anthropic answered without a content list")
        text = "".join(
            str(block.get("text", ""))
            for block in content
            if isinstance(block, dict) and block.get("type") == "text"
        )
        prompt_tokens, completion_tokens, cached = self._usage(body.get("usage"))
        return Completion(
            text=text,
            input_tokens=prompt_tokens,
            output_tokens=completion_tokens,
            cached_input_tokens=cached,
            finish_reason=str(body.get("stop_reason") or "end_turn"),
        )

    async def stream(self, request: ProviderRequest) -> AsyncIterator[Chunk | Completion]:
        pieces: list[str] = []
        finish = "end_turn"
        input_usage: object = None
        output_tokens = 0
        finished = False
        try:
            async with self._client.stream(
                "POST", "v1/messages", json=self._body(request, True), timeout=request.timeout
            ) as response:
                if response.status_code >= 400:
                    await response.aread()
                    raise_for_status(self.name, response)
                async for event, data in sse_events(self.name, response):
                    kind = event or (str(data.get("type", "")) if data else "")
                    if data is None:
                        continue
                    if kind == "error":
                        error = data.get("error") if isinstance(data.get("error"), dict) else {}
                        error_type = str(error.get("type", ""))[:64] if isinstance(error, dict) else ""
                        if error_type in ("overloaded_error", "api_error"):
                            raise ProviderUnavailable(f"anthropic failed mid-stream ({error_type})")
                        if error_type == "rate_limit_error":
                            raise ProviderRateLimited("anthropic rate-limited mid-stream")
                        raise ProviderBadResponse(f"anthropic failed mid-stream ({error_type or 'unknown'})")
                    if kind == "message_start":
                        message = data.get("message")
                        input_usage = message.get("usage") if isinstance(message, dict) else None
                    elif kind == "content_block_delta":
                        delta = data.get("delta")
                        piece = delta.get("text") if isinstance(delta, dict) else None
                        if isinstance(piece, str) and piece:
                            pieces.append(piece)
                            yield Chunk(piece)
                    elif kind == "message_delta":
                        delta = data.get("delta")
                        if isinstance(delta, dict) and delta.get("stop_reason"):
                            finish = str(delta["stop_reason"])
                        usage = data.get("usage")
                        if isinstance(usage, dict):
                            output_tokens = _int(usage.get("output_tokens"))
                    elif kind == "message_stop":
                        finished = True
                        break
        except httpx.HTTPError as exc:
            raise _translate(self.name, exc, request.timeout) from exc
        if not finished:
            raise ProviderBadResponse("anthropic's stream ended without message_stop")
        prompt_tokens, _, cached = self._usage(input_usage)
        yield Completion(
            text="".join(pieces),
            input_tokens=prompt_tokens,
            output_tokens=output_tokens,
            cached_input_tokens=cached,
            finish_reason=finish,
        )

    async def close(self) -> None:
        await self._client.aclose()
