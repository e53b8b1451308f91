"""Deterministic ids: two replicas that see the same external object agree on its id."""

from __future__ import annotations

import uuid

AGENT_NAMESPACE = uuid.UUID("6f1f3f3e-6a0c-5b8e-9a57-5061726c6579")  # fixed: changing it renames every agent


def agent_id(name: str) -> uuid.UUID:
    return uuid.uuid5(AGENT_NAMESPACE, f"agent:{name}")


def entity_id(agent: uuid.UUID, source: str, sender_id: str) -> uuid.UUID:
    return uuid.uuid5(agent, f"{source}:entity:{sender_id}")


def room_id(agent: uuid.UUID, source: str, channel_id: str) -> uuid.UUID:
    return uuid.uuid5(agent, f"{source}:room:{channel_id}")


def world_id(agent: uuid.UUID, source: str, external_world_id: str) -> uuid.UUID:
    return uuid.uuid5(agent, f"{source}:world:{external_world_id}")


def message_id(agent: uuid.UUID, source: str, external_message_id: str) -> uuid.UUID:
    return uuid.uuid5(agent, f"{source}:message:{external_message_id}")


def response_id(inbound: uuid.UUID, index: int = 0) -> uuid.UUID:
    """The id of the ``index``-th reply to an inbound message: a retried turn republishes the same id."""
    return uuid.uuid5(inbound, f"response:{index}")
