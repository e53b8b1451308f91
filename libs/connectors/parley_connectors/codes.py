"""Error codes raised by the connector kit on the connector's side."""

from __future__ import annotations

from parley_platform.errors import Catalog, Kind

CATALOG = Catalog("connectors", "Raised on a connector's side by the connector kit (libs/connectors).")

CREDENTIALS_INVALID = CATALOG.define(
    "CREDENTIALS_INVALID",
    Kind.INVALID_ARGUMENT,
    "A connector credentials file (or its environment) is missing, unreadable or lacks a field; the "
    "message names the field, never a secret.",
    hint="write one with `parley connectors add NAME --agent AGENT --source SOURCE --out FILE`",
)
INBOUND_INVALID = CATALOG.define(
    "INBOUND_INVALID",
    Kind.INVALID_ARGUMENT,
    "An inbound message lacks a field the runtime needs (message_id, sender_id, its agent) or has an "
    "unknown room type.",
)
SEND_GAVE_UP = CATALOG.define(
    "SEND_GAVE_UP",
    Kind.UNAVAILABLE,
    "An inbound message could not be published within the connector's retry time (NATS or "
    "JetStream was down all along); sending it again later is safe, it is deduplicated by its id.",
    retryable=True,
)
CANCEL_UNSERVED = CATALOG.define(
    "CANCEL_UNSERVED",
    Kind.UNAVAILABLE,
    "Nothing serves turn cancellation on the cancel subject (no runtime running, or one too old to "
    "cancel turns).",
    hint="is the runtime running?",
    retryable=True,
)
CONNECTOR_CLOSED = CATALOG.define(
    "CONNECTOR_CLOSED", Kind.FAILED_PRECONDITION, "The connector was closed; it sends and receives no more."
)
