"""``RuntimeServices`` for one turn: what actions, providers and evaluators may ask of the runtime,
scoped to the turn's agent, room and sender; and building the ``TurnContext`` they see."""

from __future__ import annotations

import asyncio
import functools
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from ..agents.directory import AgentInfo
from ..documents.domain import Requester
from ..documents.store import DocumentStore
from ..names import PRIVATE_ROOMS
from ..plugins.catalog import describe
from ..records import StoredMemory
from ..sdk import HistoryLine, KnowledgeHit, MemoryHit, NewMemory, Participant, PendingCall, TurnContext
from ..store import RuntimeStore
from .approvals import Approvals
from .inbound import Inbound
from .ports import Model
from .prompt import Segment

# The most texts one Embed call takes (the model gateway's limit).
EMBED_BATCH = 256


@dataclass(frozen=True)
class Resources:
    """What every turn's services draw on."""

    store: RuntimeStore
    documents: DocumentStore
    model: Model
    approvals: Approvals


class TurnServices:
    def __init__(self, resources: Resources, agent: AgentInfo, message: Inbound) -> None:
        self.r = resources
        self.agent = agent
        self.message = message
        self.ctx: TurnContext | None = None  # set by ``context``, which builds both
        # What the turn's ingest statement already read: whether the agent has memories of a kind
        # (``facts``) and ``documents``. Absent: ask the database when it matters.
        self.present: dict[str, bool] = {}
        # The embeddings this turn asked for, by text: the message's is asked for once, whether
        # facts, documents or both are searched with it, and is stored as the message's own.
        self._embeddings: dict[str, asyncio.Future[list[float]]] = {}

    def _context(self) -> TurnContext:
        assert self.ctx is not None
        return self.ctx

    async def set_room_state(self, state: str | None, *, mute_until: datetime | None = None) -> None:
        await self.r.store.set_room_state(self.agent.id, self.message.room_id, state, mute_until)

    async def embedding(self, text: str) -> list[float]:
        """``text``'s embedding, computed once in the turn however many ask for it (a failure is
        not kept: the next caller asks again)."""
        future = self._embeddings.get(text)
        if future is None:
            future = asyncio.ensure_future(self._embed_one(text))
            self._embeddings[text] = future
            future.add_done_callback(functools.partial(self._embedded, text))
        # Shielded: a caller that gives up (a provider's timeout) does not cancel it for the others.
        return await asyncio.shield(future)

    async def _embed_one(self, text: str) -> list[float]:
        [vector] = await self.r.model.embed([text], self.agent.id)
        return vector

    def _embedded(self, text: str, future: asyncio.Future[list[float]]) -> None:
        failed = future.cancelled() or future.exception() is not None
        if failed and self._embeddings.get(text) is future:
            del self._embeddings[text]

    def embedded(self, text: str) -> list[float] | None:
        """``text``'s embedding if the turn has computed it already."""
        future = self._embeddings.get(text)
        if future is None or not future.done() or future.cancelled() or future.exception() is not None:
            return None
        return future.result()

    async def search_memories(self, text: str, *, kind: str = "facts", limit: int = 5) -> list[MemoryHit]:
        present = self.present.get(kind)
        if present is None:
            present = await self.r.store.has_memories(self.agent.id, kind)
        if not present:
            return []
        vector = await self.embedding(text)
        found = await self.r.store.search_memories(self.agent.id, vector, kind=kind, limit=limit)
        return [MemoryHit(str(m.id), m.kind, m.text, m.similarity, m.created_at) for m in found]

    async def remember(self, kind: str, text: str, *, metadata: Mapping[str, Any] | None = None) -> uuid.UUID:
        [memory_id] = await self.remember_all([NewMemory(kind, text, metadata)])
        return memory_id

    async def remember_all(self, memories: Sequence[NewMemory]) -> list[uuid.UUID]:
        if not memories:
            return []
        room_id = self.message.room_id
        ids = [uuid.uuid5(self.agent.id, f"{m.kind}:{room_id}:{m.text}") for m in memories]
        unique = list(dict(zip(ids, memories, strict=True)).items())  # the same memory once
        vectors: list[list[float]] = []
        for start in range(0, len(unique), EMBED_BATCH):
            texts = [m.text for _, m in unique[start : start + EMBED_BATCH]]
            vectors.extend(await self.r.model.embed(texts, self.agent.id))
        await self.r.store.remember(
            agent_id=self.agent.id,
            room_id=room_id,
            entity_id=self.message.sender_id,
            source=self.message.source,
            memories=[
                StoredMemory(memory_id, m.kind, m.text, vector, dict(m.metadata or {}))
                for (memory_id, m), vector in zip(unique, vectors, strict=True)
            ],
        )
        for m in memories:
            self.present[m.kind] = True
        return ids

    async def relate(
        self,
        source_entity_id: str,
        target_entity_id: str,
        *,
        tags: Sequence[str],
        metadata: Mapping[str, Any] | None = None,
    ) -> uuid.UUID:
        return await self.r.store.relate(
            agent_id=self.agent.id,
            source_entity_id=uuid.UUID(source_entity_id),
            target_entity_id=uuid.UUID(target_entity_id),
            tags=tags,
            metadata=dict(metadata or {}),
        )

    async def generate(self, prompt: str, *, small: bool = False, structured: bool = False) -> str:
        return await self.r.model.generate(
            self.agent.id, [Segment(prompt, stable=False)], small=small, structured=structured
        )

    def get_setting(self, key: str) -> object | None:
        return self.agent.setting(key)

    async def action_catalog(self) -> str:
        return describe(await self.agent.catalog.available(self._context()))

    async def search_documents(self, text: str, *, limit: int = 5) -> list[KnowledgeHit]:
        documents = self.r.documents
        if not text.strip():
            return []
        present = self.present.get("documents")
        if present is None:
            present = await documents.has_documents(self.agent.id)
        if not present:
            return []
        vector = await self.embedding(text)
        # As the sender: the rules of their roles apply inside the search's SQL. In a room of one
        # person with the agent, that is everything they may read; in a shared room only the room's
        # global documents, so nothing private to one participant is quoted to the others.
        private = self.message.room_type in PRIVATE_ROOMS and not self.message.autonomous
        found = await documents.search(
            self.agent.id,
            Requester(self.message.sender_id),
            vector,
            limit,
            room_id=None if private else self.message.room_id,
            scopes=None if private else ("global",),
        )
        return [KnowledgeHit(str(f.document_id), f.title, f.position, f.text, f.similarity) for f in found]

    async def pending_confirmations(self) -> list[PendingCall]:
        return await self.r.approvals.pending(self.agent, self.message.room_id)

    async def decide_confirmation(self, tool_call_id: str, *, approve: bool, reason: str = "") -> str:
        return await self.r.approvals.decide(
            self.agent, tool_call_id, approve=approve, reason=reason, decided_by=str(self.message.sender_id)
        )


def context(
    resources: Resources,
    agent: AgentInfo,
    message: Inbound,
    *,
    role: str,
    history: Sequence[HistoryLine] = (),
    participants: Sequence[Participant] = (),
    present: Mapping[str, bool | None] | None = None,
    room_turn: int = 0,
) -> TurnContext:
    """What handlers see of the turn of ``message``; also rebuilt to run a confirmed action.
    ``present``: what is known to exist already (``facts``, ``documents``; None: not known)."""
    services = TurnServices(resources, agent, message)
    services.present = {k: v for k, v in (present or {}).items() if v is not None}
    ctx = TurnContext(
        agent_id=agent.id,
        character=agent.character,
        message=message.view(),
        role=role,
        history=history,
        participants=participants,
        services=services,
        room_turn=room_turn,
    )
    services.ctx = ctx
    return ctx
