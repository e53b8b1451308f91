"""The pairing service's error codes (INVALID_ID and INVALID_PAGE are the platform's)."""

from __future__ import annotations

from parley_platform.errors import Catalog, Kind

CATALOG = Catalog("pairing", "The pairing service: pairing requests and codes, approvals, the allowlist.")
define = CATALOG.define

# Requests
AGENT_REQUIRED = define("AGENT_REQUIRED", Kind.INVALID_ARGUMENT, "The request names no agent_id.")
INVALID_AGENT_ID = define(
    "INVALID_AGENT_ID",
    Kind.INVALID_ARGUMENT,
    "The agent_id is not an agent's UUID.",
    hint="list them with `parley agents`",
)
CHANNEL_REQUIRED = define(
    "CHANNEL_REQUIRED", Kind.INVALID_ARGUMENT, "The request names no channel (the connector, e.g. discord)."
)
INVALID_CHANNEL = define(
    "INVALID_CHANNEL",
    Kind.INVALID_ARGUMENT,
    "The channel is not 1 to 64 letters, digits or _ . : - starting with a letter or digit.",
)
CODE_REQUIRED = define(
    "CODE_REQUIRED", Kind.INVALID_ARGUMENT, "An approval or denial carries no pairing code."
)
INVALID_CODE = define(
    "INVALID_CODE",
    Kind.INVALID_ARGUMENT,
    "The pairing code is not 8 characters of the code alphabet (the code itself is not echoed).",
    hint="copy it from the pairing reply or `parley pairing list <channel>`",
)
INVALID_METADATA = define(
    "INVALID_METADATA",
    Kind.INVALID_ARGUMENT,
    "The metadata has more than 32 entries, a key that is empty, too long or holds control characters,"
    " or a value that is too long or holds NUL.",
)
INVALID_FIELD = define(
    "INVALID_FIELD",
    Kind.INVALID_ARGUMENT,
    "A declared request field was sent with another wire type than the one it is declared with.",
)

# Codes and the allowlist
CODE_NOT_FOUND = define(
    "CODE_NOT_FOUND",
    Kind.NOT_FOUND,
    "No live pending request of the agent and channel has that code: it expired, was used, or never existed.",
    hint="codes expire; see the live ones with `parley pairing list <channel>`",
)
UPSERT_CONTENDED = define(
    "UPSERT_CONTENDED",
    Kind.CONFLICT,
    "Concurrent requests kept taking the channel's pending slots while this one was written.",
    retryable=True,
)
ALLOWLIST_CONTENDED = define(
    "ALLOWLIST_CONTENDED",
    Kind.CONFLICT,
    "Concurrent additions of the same sender kept racing this one.",
    retryable=True,
)

# Connectors
INVALID_CONNECTOR_NAME = define(
    "INVALID_CONNECTOR_NAME",
    Kind.INVALID_ARGUMENT,
    "A connector name is 1 to 63 lower-case letters, digits, '_' or '-' starting with a letter, and not"
    " the name of a service identity.",
)
INVALID_SOURCE = define(
    "INVALID_SOURCE",
    Kind.INVALID_ARGUMENT,
    "A connector's source is not 1 to 64 letters, digits, '_' or '-'.",
)
INVALID_CONNECTOR_KIND = define(
    "INVALID_CONNECTOR_KIND", Kind.INVALID_ARGUMENT, "A connector's kind is neither nats nor web."
)
INVALID_API_KEY_DIGEST = define(
    "INVALID_API_KEY_DIGEST",
    Kind.INVALID_ARGUMENT,
    "An API key is looked up by its SHA-256 digest: 32 bytes.",
)
CONNECTOR_EXISTS = define(
    "CONNECTOR_EXISTS",
    Kind.CONFLICT,
    "A connector of this name exists (or existed: a revoked name is not reused).",
    hint="choose another name; list them with `parley connectors list`",
)
CONNECTOR_NOT_FOUND = define(
    "CONNECTOR_NOT_FOUND",
    Kind.NOT_FOUND,
    "No connector of this name, or it is revoked already.",
    hint="list them with `parley connectors list --all`",
)
