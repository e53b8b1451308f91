"""The web service's error codes. Each is answered in the OpenAI error shape
(``{"error": {"message", "type", "param", "code"}}``) with the HTTP status of its kind."""

from __future__ import annotations

from parley_platform.errors import Catalog, Kind

CATALOG = Catalog("web", "The web connector: the chat page and the OpenAI-compatible API.")
define = CATALOG.define

INVALID_API_KEY = define(
    "INVALID_API_KEY",
    Kind.UNAUTHENTICATED,
    "No API key, or one that no web connector of this deployment holds (unknown or revoked).",
    hint="send `Authorization: Bearer <api_key>` with the key of `parley connectors add NAME --kind web`",
)
MODEL_NOT_FOUND = define(
    "MODEL_NOT_FOUND",
    Kind.NOT_FOUND,
    "The model names no agent this API key may talk to.",
    hint="GET /v1/models lists them",
)
INVALID_REQUEST = define(
    "INVALID_REQUEST",
    Kind.INVALID_ARGUMENT,
    "The request body is not a chat completion request this service can answer.",
    hint="send JSON with model and messages, the last of them from the user with text content",
)
REPLY_TIMEOUT = define(
    "REPLY_TIMEOUT",
    Kind.DEADLINE_EXCEEDED,
    "The agent did not reply within PARLEY_WEB_REPLY_TIMEOUT_SECONDS.",
    hint="the reply may still come: it is kept in the conversation's history",
    retryable=True,
)
TURN_ENDED = define(
    "TURN_ENDED",
    Kind.CONFLICT,
    "The agent's turn ended without a reply: a newer message of the same user superseded it, or it was"
    " cancelled.",
    hint="send one message at a time per user, or read the reply to the newer one",
)
