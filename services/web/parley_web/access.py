"""Who is asking and what they may reach: API keys checked with the pairing service (by digest:
the key itself never leaves this process), agents' names from the runtime, a user's conversation
from the runtime's memories."""

from __future__ import annotations

import hashlib
import time
import uuid
from dataclasses import dataclass

from parley.v1 import common_pb2, pairing_pb2, runtime_pb2
from parley.v1.pairing_nats import PairingClient
from parley.v1.runtime_nats import RuntimeClient
from parley_platform import permissions
from parley_platform.errors import Kind, ParleyError

from . import errors

# The runtime's room ids (parley_runtime.ids.room_id): uuid5 of the agent's id and
# "<source>:room:<channel_id>". tests/unit/test_web_parts.py checks that both agree.
ROOM_NAME = "{source}:room:{channel_id}"


def room_id(agent_id: str, channel_id: str) -> str:
    return str(
        uuid.uuid5(
            uuid.UUID(agent_id), ROOM_NAME.format(source=permissions.WEB_SOURCE, channel_id=channel_id)
        )
    )


@dataclass(frozen=True)
class Caller:
    """The web connector an API key belongs to: its name and the one agent it may talk to."""

    connector: str
    agent_id: str

    def sender(self, user: str) -> str:
        """Each key plus the request's ``user`` names a sender (and its room): `<connector>:<user>`."""
        return f"{self.connector}:{user or 'default'}"


@dataclass
class _Cached:
    value: object
    until: float


class Cache:
    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.entries: dict[object, _Cached] = {}

    def get(self, key: object) -> object | None:
        entry = self.entries.get(key)
        if entry is None or entry.until < time.monotonic():
            self.entries.pop(key, None)
            return None
        return entry.value

    def put(self, key: object, value: object) -> None:
        if len(self.entries) > 10_000:
            self.entries.clear()
        self.entries[key] = _Cached(value, time.monotonic() + self.seconds)


class Access:
    def __init__(
        self, pairing: PairingClient, runtime: RuntimeClient, *, cache_seconds: float, history_limit: int
    ) -> None:
        self.pairing = pairing
        self.runtime = runtime
        self.keys = Cache(cache_seconds)
        self.names = Cache(cache_seconds)
        self.history_limit = history_limit

    async def caller(self, authorization: str) -> Caller:
        """The caller of an ``Authorization: Bearer <key>`` header; INVALID_API_KEY otherwise."""
        scheme, _, key = authorization.partition(" ")
        key = key.strip()
        if scheme.lower() != "bearer" or not key:
            raise errors.INVALID_API_KEY("no API key: send Authorization: Bearer <api_key>")
        digest = hashlib.sha256(key.encode()).digest()
        cached = self.keys.get(digest)
        if isinstance(cached, Caller):
            return cached
        try:
            reply = await self.pairing.ConnectorByApiKey(
                pairing_pb2.ConnectorByApiKeyRequest(api_key_digest=digest)
            )
        except ParleyError as exc:
            if exc.kind is Kind.NOT_FOUND:
                raise errors.INVALID_API_KEY("incorrect API key provided") from exc
            raise
        found = Caller(reply.connector.name, reply.connector.agent_id)
        self.keys.put(digest, found)
        return found

    async def agent_name(self, agent_id: str) -> str:
        cached = self.names.get(agent_id)
        if isinstance(cached, str):
            return cached
        names: dict[str, str] = {}
        offset = 0
        while True:
            reply = await self.runtime.ListAgents(
                runtime_pb2.ListAgentsRequest(page=common_pb2.PageRequest(limit=100, offset=offset))
            )
            for agent in reply.agents:
                names[agent.id] = agent.name
                self.names.put(agent.id, agent.name)
            if not reply.page.has_more:
                break
            offset = reply.page.next_offset
        name = names.get(agent_id)
        if name is None:
            raise errors.MODEL_NOT_FOUND("the agent of this API key does not exist any more")
        return name

    async def model(self, caller: Caller, model: str) -> str:
        """The agent id ``model`` names (the agent's name, or its id), if this caller may reach it."""
        if model in (caller.agent_id, await self.agent_name(caller.agent_id)):
            return caller.agent_id
        raise errors.MODEL_NOT_FOUND(
            f"The model `{model[:100]}` does not exist or you do not have access to it."
        )

    async def history(self, caller: Caller, user: str) -> list[runtime_pb2.Memory]:
        """The latest messages of the caller's room with ``user``, oldest first."""
        reply = await self.runtime.ListMemories(
            runtime_pb2.ListMemoriesRequest(
                agent_id=caller.agent_id,
                room_id=room_id(caller.agent_id, caller.sender(user)),
                table="messages",
                page=common_pb2.PageRequest(limit=self.history_limit),
            )
        )
        return sorted(reply.memories, key=lambda m: m.created_at.ToNanoseconds())
