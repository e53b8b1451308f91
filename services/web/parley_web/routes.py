"""The HTTP side: the chat page, ``/v1/models`` and ``/v1/chat/completions`` in the OpenAI API's
shapes (errors included), and the page's history. Every route but the page takes an API key."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from sse_starlette.sse import EventSourceResponse
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp

from parley_connectors import Inbound
from parley_platform.errors import Kind, ParleyError
from parley_platform.logging import get_logger

from . import errors
from .access import Access, Caller
from .relay import Delta, Done, Relay

log = get_logger(__name__)

STATIC = Path(__file__).parent / "static"
HTTP_STATUS = {
    Kind.INVALID_ARGUMENT: 400,
    Kind.UNAUTHENTICATED: 401,
    Kind.PERMISSION_DENIED: 403,
    Kind.NOT_FOUND: 404,
    Kind.CONFLICT: 409,
    Kind.FAILED_PRECONDITION: 400,
    Kind.RESOURCE_EXHAUSTED: 429,
    Kind.UNAVAILABLE: 503,
    Kind.DEADLINE_EXCEEDED: 504,
}
OPENAI_CODE = {"INVALID_API_KEY": "invalid_api_key", "MODEL_NOT_FOUND": "model_not_found"}


def error_body(exc: ParleyError, param: str | None = None) -> dict[str, Any]:
    """OpenAI's error object: {"error": {"message", "type", "param", "code"}}."""
    status = HTTP_STATUS.get(exc.kind, 500)
    kind = "invalid_request_error" if status < 500 else "server_error"
    if exc.kind is Kind.DEADLINE_EXCEEDED:
        kind = "timeout"
    return {
        "error": {
            "message": exc.message,
            "type": kind,
            "param": param,
            "code": OPENAI_CODE.get(exc.code, exc.code.lower()),
        }
    }


def error_response(exc: ParleyError) -> JSONResponse:
    param = "model" if exc.code == "MODEL_NOT_FOUND" else None
    return JSONResponse(error_body(exc, param), status_code=HTTP_STATUS.get(exc.kind, 500))


def text_of(content: Any) -> str:
    """A message's content: a string, or a list of parts of which the text parts count."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = [p.get("text") for p in content if isinstance(p, dict) and p.get("type") == "text"]
        if all(isinstance(p, str) for p in parts):
            return "".join(parts)  # type: ignore[arg-type]
    raise errors.INVALID_REQUEST("message content must be a string or a list of text parts")


def parse_request(body: Any, max_chars: int) -> tuple[str, str, bool, str]:
    """(model, the last user message's text, stream, user) of a chat completion request."""
    if not isinstance(body, dict):
        raise errors.INVALID_REQUEST("the body must be a JSON object")
    model, messages = body.get("model"), body.get("messages")
    if not isinstance(model, str) or not model:
        raise errors.INVALID_REQUEST("model is required: the agent's name")
    if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
        raise errors.INVALID_REQUEST("messages must be a non-empty list of message objects")
    users = [m for m in messages if m.get("role") == "user"]
    if not users:
        raise errors.INVALID_REQUEST("messages holds no user message")
    text = text_of(users[-1].get("content"))
    if not text.strip():
        raise errors.INVALID_REQUEST("the last user message is empty")
    if len(text) > max_chars:
        raise errors.INVALID_REQUEST(f"the last user message is longer than {max_chars} characters")
    stream, user = body.get("stream", False), body.get("user", "")
    if not isinstance(stream, bool):
        raise errors.INVALID_REQUEST("stream must be true or false")
    if not isinstance(user, str) or len(user) > 256:
        raise errors.INVALID_REQUEST("user must be a string of at most 256 characters")
    return model, text, stream, user


class WebApi:
    def __init__(
        self,
        access: Access,
        relay: Relay,
        *,
        reply_timeout: float,
        max_chars: int,
        mcp: ASGIApp | None = None,
    ) -> None:
        self.mcp = mcp
        self.access = access
        self.relay = relay
        self.reply_timeout = reply_timeout
        self.max_chars = max_chars

    def app(self) -> Starlette:
        return Starlette(
            routes=[
                Route("/", self.page),
                Route("/v1/models", self.models),
                Route("/v1/chat/completions", self.completions, methods=["POST"]),
                Route("/api/history", self.history),
                *([Route("/mcp", self.mcp)] if self.mcp is not None else []),
            ],
            exception_handlers={ParleyError: self.on_error},  # type: ignore[dict-item]
        )

    async def on_error(self, request: Request, exc: ParleyError) -> Response:
        if HTTP_STATUS.get(exc.kind, 500) >= 500:
            log.warning("request failed", path=request.url.path, code=exc.code, error=exc.message)
        return error_response(exc)

    async def page(self, request: Request) -> Response:
        return FileResponse(STATIC / "index.html", media_type="text/html")

    async def caller(self, request: Request) -> Caller:
        return await self.access.caller(request.headers.get("authorization", ""))

    async def models(self, request: Request) -> Response:
        caller = await self.caller(request)
        name = await self.access.agent_name(caller.agent_id)
        model = {"id": name, "object": "model", "created": 0, "owned_by": "parley"}
        return JSONResponse({"object": "list", "data": [model]})

    async def history(self, request: Request) -> Response:
        caller = await self.caller(request)
        agent_id = await self.access.model(caller, request.query_params.get("model", ""))
        memories = await self.access.history(caller, request.query_params.get("user", ""))
        messages = [
            {"role": "assistant" if m.entity_id == agent_id else "user", "content": m.text, "id": m.id}
            for m in memories
            if m.text
        ]
        return JSONResponse({"messages": messages})

    async def completions(self, request: Request) -> Response:
        caller = await self.caller(request)
        try:
            body = await request.json()
        except (ValueError, UnicodeDecodeError) as exc:
            raise errors.INVALID_REQUEST("the body is not JSON") from exc
        model, text, stream, user = parse_request(body, self.max_chars)
        agent_id = await self.access.model(caller, model)
        sender = caller.sender(user)
        message = Inbound(
            agent_id=agent_id,
            message_id=uuid.uuid4().hex,
            sender_id=sender,
            sender_name=user or caller.connector,
            channel_id=sender,
            room_type="dm",
            text=text,
            metadata={"connector": caller.connector},
        )
        meta = {"id": f"chatcmpl-{message.message_id}", "created": int(time.time()), "model": model}
        if stream:
            return EventSourceResponse(self.stream(message, meta), ping=15)
        async with self.relay.waiting(agent_id, message.message_id) as waiter:
            await self.relay.send(message)
            end = None
            try:
                async for event in waiter.events(self.reply_timeout):
                    if isinstance(event, Done):
                        end = event
            except TimeoutError as exc:
                raise errors.REPLY_TIMEOUT(f"no reply within {self.reply_timeout:g} s") from exc
        assert end is not None
        if end.outcome != "completed":
            raise errors.TURN_ENDED(f"the agent's turn ended without a reply: {end.outcome}")
        return JSONResponse(
            {
                **meta,
                "object": "chat.completion",
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": end.text},
                        "finish_reason": "stop",
                    }
                ],
                "usage": {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0},
            }
        )

    async def stream(self, message: Inbound, meta: dict[str, Any]) -> AsyncIterator[str]:
        def chunk(delta: dict[str, str], finish: str | None = None) -> str:
            choice = {"index": 0, "delta": delta, "finish_reason": finish}
            return json.dumps({**meta, "object": "chat.completion.chunk", "choices": [choice]})

        async with self.relay.waiting(message.agent_id, message.message_id) as waiter:
            await self.relay.send(message)
            finished = False
            try:
                yield chunk({"role": "assistant", "content": ""})
                async for event in waiter.events(self.reply_timeout):
                    if isinstance(event, Delta):
                        yield chunk({"content": event.text})
                    elif event.outcome != "completed":
                        finished = True
                        ended = errors.TURN_ENDED(f"the agent's turn ended without a reply: {event.outcome}")
                        yield json.dumps(error_body(ended))
                if not finished:
                    finished = True
                    yield chunk({}, "stop")
            except TimeoutError:
                finished = True
                failure = errors.REPLY_TIMEOUT(f"no reply within {self.reply_timeout:g} s")
                yield json.dumps(error_body(failure))
            finally:
                if not finished:  # the reader went away: the turn need not go on for it
                    with contextlib.suppress(ParleyError):
                        await asyncio.shield(
                            self.relay.cancel(message.agent_id, message.message_id, "closed")
                        )
        yield "[DONE]"
