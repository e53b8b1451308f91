"""Deterministic ids: two replicas that see the same external object agree on its id.

Each is a SHA-1 (``uuid5``) of its names; a turn derives several, some more than once, so the
recent ones are remembered (pure functions: the cache changes no id)."""

from __future__ import annotations

import functools
import uuid

_remembered = functools.lru_cache(maxsize=16384)

AGENT_NAMESPACE = uuid.UUID("6f1f3f3e-6a0c-5b8e-9a57-5061726c6579")  # fixed: changing it renames every agent


def agent_id(name: str) -> uuid.UUID:
    return uuid.uuid5(AGENT_NAMESPACE, f"agent:{name}")


@_remembered
def entity_id(agent: uuid.UUID, source: str, sender_id: str) -> uuid.UUID:
    return uuid.uuid5(agent, f"{source}:entity:{sender_id}")


@_remembered
def room_id(agent: uuid.UUID, source: str, channel_id: str) -> uuid.UUID:
    return uuid.uuid5(agent, f"{source}:room:{channel_id}")


@_remembered
def world_id(agent: uuid.UUID, source: str, external_world_id: str) -> uuid.UUID:
    return uuid.uuid5(agent, f"{source}:world:{external_world_id}")


def message_id(agent: uuid.UUID, source: str, external_message_id: str) -> uuid.UUID:
    return uuid.uuid5(agent, f"{source}:message:{external_message_id}")


@_remembered
def response_id(inbound: uuid.UUID, index: int = 0) -> uuid.UUID:
    """The id of the ``index``-th reply to an inbound message: a retried turn republishes the same id."""
    return uuid.uuid5(inbound, f"response:{index}")
