"""A character's ``knowledge`` as the agent's documents: each text one global document.

A text's document id is derived from the agent and the text, so loading the same character again
(another replica, a restart, ``parley agents add`` twice) adds nothing, and two replicas that race
to add it store it once (the second insert fails on the key and finds the first). Texts are added
in the background, with retries while the model gateway (embeddings) is not there yet; they never
hold up serving the agent.
"""

from __future__ import annotations

import asyncio
import hashlib
import uuid
from collections.abc import Sequence
from typing import Any, Protocol

from parley_platform.errors import ParleyError
from parley_platform.logging import get_logger

from ..character import Character, KnowledgeItem
from .api import Embed, embed_all
from .domain import MARKDOWN, PLAIN, Requester, Scope, chunk
from .store import DocumentStore

log = get_logger(__name__)

OPERATOR = Requester(None, operator=True)
KNOWLEDGE_NAMESPACE = uuid.UUID("0d7c2f52-5a53-5d0e-9d3c-6b6e6f776c65")
TITLE_CHARS = 80


def document_id(agent_id: uuid.UUID, text: str) -> uuid.UUID:
    digest = hashlib.sha256(text.encode()).hexdigest()
    return uuid.uuid5(KNOWLEDGE_NAMESPACE, f"{agent_id}:{digest}")


def title_of(item: KnowledgeItem) -> str:
    return item.path or " ".join(item.text.split())[:TITLE_CHARS]


class Served(Protocol):
    @property
    def id(self) -> uuid.UUID: ...
    @property
    def character(self) -> Character: ...


class CharacterKnowledge:
    def __init__(self, store: DocumentStore, embed: Embed, *, retry_seconds: float = 2.0) -> None:
        self.store = store
        self.embed = embed
        self.retry_seconds = retry_seconds
        self._tasks: set[asyncio.Task[None]] = set()

    def load(self, agent_id: uuid.UUID, character: Character) -> None:
        """Add the character's knowledge in the background (nothing to do when there is none)."""
        if not character.knowledge:
            return
        task = asyncio.ensure_future(self._keep_trying(agent_id, character.name, character.knowledge))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def on_loaded(self, agent: Served) -> None:
        self.load(agent.id, agent.character)

    async def _keep_trying(self, agent_id: uuid.UUID, name: str, items: Sequence[KnowledgeItem]) -> None:
        for attempt in range(1, 31):
            try:
                added = await self.sync(agent_id, items)
            except ParleyError as exc:
                log.warning("character knowledge not added yet", agent=name, attempt=attempt, error=str(exc))
                await asyncio.sleep(min(self.retry_seconds * attempt, 30.0))
                continue
            if added:
                log.info("character knowledge added", agent=name, documents=added)
            return
        log.error("character knowledge not added: giving up", agent=name)

    async def sync(self, agent_id: uuid.UUID, items: Sequence[KnowledgeItem]) -> int:
        """Add the texts that are not documents yet; how many were added."""
        added = 0
        for item in items:
            doc_id = document_id(agent_id, item.text)
            if await self.store.get(agent_id, OPERATOR, doc_id, False) is not None:
                continue
            content_type = MARKDOWN if item.path.lower().endswith((".md", ".markdown")) else PLAIN
            fragments = await asyncio.to_thread(chunk, item.text, content_type)
            embeddings = await embed_all(self.embed, fragments, agent_id)
            values: dict[str, Any] = {
                "room_id": None,
                "scope": Scope.GLOBAL.value,
                "scoped_to": None,
                "grants": [],
            }
            document = {
                **values,
                "id": doc_id,
                "title": title_of(item),
                "content_type": content_type,
                "text": item.text,
                "size_bytes": len(item.text.encode()),
            }
            try:
                stored = await self.store.add(agent_id, OPERATOR, document, fragments, embeddings)
            except ParleyError:
                if await self.store.get(agent_id, OPERATOR, doc_id, False) is None:
                    raise
                continue  # another replica added it first
            if stored is not None:
                added += 1
        return added

    async def drain(self, timeout: float) -> None:
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=timeout)
