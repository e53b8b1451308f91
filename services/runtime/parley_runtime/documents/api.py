"""``parley.v1.Documents``: one async method per RPC, served over gRPC and NATS."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable, Sequence
from pathlib import PurePath
from typing import Protocol

from parley.v1 import documents_pb2
from parley_platform.convert import timestamp, uuid_of
from parley_platform.errors import ParleyError
from parley_platform.paging import cut, page_of

from .. import errors
from .domain import (
    EMBED_BATCH,
    MAX_TITLE_CHARS,
    AddCheck,
    Document,
    Requester,
    Scope,
    chunk,
    extract,
    grants_of,
    search_limit,
)
from .store import DocumentStore

Embed = Callable[[Sequence[str], uuid.UUID], Awaitable[list[list[float]]]]


class Agent(Protocol):
    @property
    def id(self) -> uuid.UUID: ...


class Agents(Protocol):
    """Finds an agent by id or name (the runtime's agent directory)."""

    async def require(self, ref: str) -> Agent: ...


SCOPE_FROM_PROTO = {
    documents_pb2.DOCUMENT_SCOPE_UNSPECIFIED: Scope.GLOBAL,
    documents_pb2.DOCUMENT_SCOPE_GLOBAL: Scope.GLOBAL,
    documents_pb2.DOCUMENT_SCOPE_OWNER_PRIVATE: Scope.OWNER_PRIVATE,
    documents_pb2.DOCUMENT_SCOPE_USER_PRIVATE: Scope.USER_PRIVATE,
    documents_pb2.DOCUMENT_SCOPE_AGENT_PRIVATE: Scope.AGENT_PRIVATE,
}
SCOPE_TO_PROTO = {
    scope: value
    for value, scope in SCOPE_FROM_PROTO.items()
    if value != documents_pb2.DOCUMENT_SCOPE_UNSPECIFIED
}


def requester_of(message: documents_pb2.Requester) -> Requester:
    if message.operator:
        if message.entity_id:
            raise errors.INVALID_REQUESTER("requester is either the operator or an entity, not both")
        return Requester(None, operator=True)
    if not message.entity_id:
        raise errors.REQUESTER_REQUIRED(
            "requester.entity_id is required (or requester.operator for the operator)"
        )
    return Requester(uuid_of(message.entity_id, "requester.entity_id"))


async def embed_all(embed: Embed, texts: Sequence[str], agent_id: uuid.UUID) -> list[list[float]]:
    vectors: list[list[float]] = []
    for start in range(0, len(texts), EMBED_BATCH):
        vectors += await embed(texts[start : start + EMBED_BATCH], agent_id)
    return vectors


def document_message(document: Document) -> documents_pb2.Document:
    return documents_pb2.Document(
        id=str(document.id),
        agent_id=str(document.agent_id),
        room_id=str(document.room_id or ""),
        scope=SCOPE_TO_PROTO[document.scope],
        scoped_to_entity_id=str(document.scoped_to_entity_id or ""),
        direct_grant_entity_ids=[str(g) for g in document.direct_grant_entity_ids],
        access_revision=document.access_revision,
        title=document.title,
        content_type=document.content_type,
        fragment_count=document.fragment_count,
        size_bytes=document.size_bytes,
        created_by=str(document.created_by or ""),
        created_at=timestamp(document.created_at),
        text=document.text,
    )


def _not_found(document_id: uuid.UUID | str) -> ParleyError:
    return errors.DOCUMENT_NOT_FOUND(f"no document {document_id}")


class DocumentsApi:
    """``parley.v1.Documents``: one async method per RPC, served over gRPC and NATS."""

    def __init__(self, *, store: DocumentStore, agents: Agents, embed: Embed) -> None:
        self.store = store
        self.agents = agents
        self.embed = embed

    async def AddDocument(self, request: documents_pb2.AddDocumentRequest) -> documents_pb2.Document:
        requester = requester_of(request.requester)
        if request.scope not in SCOPE_FROM_PROTO:
            raise errors.INVALID_SCOPE(f"scope {request.scope} is not a DocumentScope")
        scope = SCOPE_FROM_PROTO[request.scope]
        scoped_to = (
            uuid_of(request.scoped_to_entity_id, "scoped_to_entity_id")
            if request.scoped_to_entity_id
            else None
        )
        if (scope == Scope.USER_PRIVATE) != (scoped_to is not None):
            raise errors.INVALID_SCOPED_ENTITY(
                "scoped_to_entity_id is required for user-private documents and only for them"
            )
        grants = grants_of(request.direct_grant_entity_ids)
        room = uuid_of(request.room_id, "room_id") if request.room_id else None
        if len(request.title) > MAX_TITLE_CHARS:
            raise errors.TITLE_TOO_LONG(f"title is over {MAX_TITLE_CHARS} characters")
        if bool(request.text) == bool(request.content):
            raise errors.DOCUMENT_CONTENT_REQUIRED("give exactly one of text and content")
        agent = await self.agents.require(request.agent_id)
        values = {"room_id": room, "scope": scope.value, "scoped_to": scoped_to, "grants": grants}
        # Refuse before reading files and embedding; add_document decides again when it writes.
        check = await self.store.check_add(agent.id, requester, values)
        self._refusal(check, room)
        # Reading a PDF is CPU work: off the event loop, which turns share.
        text, content_type, size = await asyncio.to_thread(
            extract, request.text, request.content, request.content_type, request.file_name
        )
        title = request.title.strip() or PurePath(request.file_name).name or " ".join(text.split())[:80]
        fragments = await asyncio.to_thread(chunk, text, content_type)
        embeddings = await embed_all(self.embed, fragments, agent.id)
        document = await self.store.add(
            agent.id,
            requester,
            {
                **values,
                "id": uuid.uuid4(),
                "title": title,
                "content_type": content_type,
                "text": text,
                "size_bytes": size,
            },
            fragments,
            embeddings,
        )
        if document is None:
            check = await self.store.check_add(agent.id, requester, values)
            self._refusal(check, room)
            raise errors.DOCUMENT_ADD_RACED("the document could not be added; try again")
        return document_message(document)

    @staticmethod
    def _refusal(check: AddCheck, room: uuid.UUID | None) -> None:
        if not check.allowed:
            raise errors.DOCUMENT_ADD_DENIED(
                "the requester may not add a document with this scope, room and grants"
            )
        if not check.room_found:
            raise errors.ROOM_NOT_FOUND(f"no room {room} for this agent")
        if not check.entities_found:
            raise errors.UNKNOWN_ENTITY(
                "scoped_to_entity_id and every direct grant must be an entity of this agent"
            )

    async def ListDocuments(
        self, request: documents_pb2.ListDocumentsRequest
    ) -> documents_pb2.ListDocumentsResponse:
        requester = requester_of(request.requester)
        page = page_of(request.page if request.HasField("page") else None)
        room = uuid_of(request.room_id, "room_id") if request.room_id else None
        agent = await self.agents.require(request.agent_id)
        rows, total = await self.store.page(agent.id, requester, room, page.fetch, page.offset)
        rows, page_response = cut(page, rows)
        return documents_pb2.ListDocumentsResponse(
            documents=[document_message(d) for d in rows], page=page_response, total=total
        )

    async def GetDocument(self, request: documents_pb2.GetDocumentRequest) -> documents_pb2.Document:
        requester = requester_of(request.requester)
        document_id = uuid_of(request.document_id, "document_id")
        agent = await self.agents.require(request.agent_id)
        document = await self.store.get(agent.id, requester, document_id, request.include_text)
        if document is None:
            raise _not_found(document_id)
        return document_message(document)

    async def RemoveDocument(
        self, request: documents_pb2.RemoveDocumentRequest
    ) -> documents_pb2.RemoveDocumentResponse:
        requester = requester_of(request.requester)
        document_id = uuid_of(request.document_id, "document_id")
        agent = await self.agents.require(request.agent_id)
        removal = await self.store.remove(agent.id, requester, document_id)
        if removal.fragments_removed is not None:
            return documents_pb2.RemoveDocumentResponse(
                document_id=str(document_id), fragments_removed=removal.fragments_removed
            )
        if not removal.readable or await self.store.get(agent.id, requester, document_id, False) is None:
            # Not readable; or readable, and removed meanwhile by a concurrent request.
            raise _not_found(document_id)
        raise errors.DOCUMENT_CHANGE_DENIED(f"the requester may not remove document {document_id}")

    async def ReplaceDocumentGrants(
        self, request: documents_pb2.ReplaceDocumentGrantsRequest
    ) -> documents_pb2.Document:
        requester = requester_of(request.requester)
        document_id = uuid_of(request.document_id, "document_id")
        grants = grants_of(request.direct_grant_entity_ids)
        if request.expected_access_revision < 1:
            raise errors.REVISION_REQUIRED(
                "expected_access_revision is required (the document's access_revision)"
            )
        agent = await self.agents.require(request.agent_id)
        replaced = await self.store.replace_grants(
            agent.id, requester, document_id, request.expected_access_revision, grants
        )
        if replaced.document is not None:
            return document_message(replaced.document)
        if not replaced.readable:
            raise _not_found(document_id)
        if not replaced.may_grant:
            raise errors.DOCUMENT_GRANT_DENIED(
                f"the requester may not replace the grants of document {document_id}"
            )
        if not replaced.entities_found:
            raise errors.UNKNOWN_ENTITY("every direct grant must be an entity of this agent")
        current = replaced.current_revision
        if current == request.expected_access_revision:
            # The statement read the revision before a concurrent replacement committed.
            now = await self.store.get(agent.id, requester, document_id, False)
            current = now.access_revision if now is not None else None
        raise errors.ACCESS_REVISION_CHANGED(
            f"document {document_id} has access revision {current}, not {request.expected_access_revision}"
        )

    async def SearchDocuments(
        self, request: documents_pb2.SearchDocumentsRequest
    ) -> documents_pb2.SearchDocumentsResponse:
        requester = requester_of(request.requester)
        limit = search_limit(request.limit)
        if not request.query.strip():
            raise errors.QUERY_REQUIRED("query must not be empty")
        room = uuid_of(request.room_id, "room_id") if request.room_id else None
        agent = await self.agents.require(request.agent_id)
        if not await self.store.has_documents(agent.id):
            return documents_pb2.SearchDocumentsResponse()
        [vector] = await self.embed([request.query], agent.id)
        hits = await self.store.search(agent.id, requester, vector, limit, room)
        return documents_pb2.SearchDocumentsResponse(
            fragments=[
                documents_pb2.DocumentFragment(
                    document_id=str(h.document_id),
                    position=h.position,
                    text=h.text,
                    title=h.title,
                    similarity=h.similarity,
                )
                for h in hits
            ]
        )
