"""Documents (knowledge): ingestion into embedded fragments, the ``parley.v1.Documents`` API and the
KNOWLEDGE provider.

Who may read, change or re-grant a document is decided in SQL by ``runtime.allowed_documents`` and
``runtime.document_rule`` (see ``sql/schema.sql``), inside every statement that makes rows, counts,
fragments or rankings; this module only validates input, extracts and chunks text, embeds it and
maps results to messages. A document the requester may not read is NOT_FOUND exactly like a
missing one.
"""

from __future__ import annotations

import asyncio
import enum
import io
import logging
import re
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import PurePath
from typing import TYPE_CHECKING, Any

from google.protobuf.timestamp_pb2 import Timestamp

from parley.v1 import documents_pb2
from parley_platform.errors import Conflict, InvalidArgument, NotFound, PermissionDenied
from parley_platform.paging import cut, page_of
from parley_platform.postgres import Database, Row

from .context import TurnContext
from .plugin import ProviderResult
from .store import Q, _vector

if TYPE_CHECKING:  # agents imports the built-in plugin, which imports this module
    from .agents import AgentDirectory, AgentInfo

Embed = Callable[[Sequence[str], uuid.UUID], Awaitable[list[list[float]]]]

MAX_GRANTS = 1000
MAX_CONTENT_BYTES = 3 * 1024 * 1024  # under gRPC's 4 MiB message limit
MAX_TEXT_CHARS = 1_000_000
MAX_TITLE_CHARS = 500
MAX_PDF_PAGES = 2000
FRAGMENT_CHARS = 1200
EMBED_BATCH = 64  # the gateway takes at most 256 texts per Embed call
DEFAULT_SEARCH_LIMIT = 10
MAX_SEARCH_LIMIT = 100
PROVIDER_FRAGMENTS = 5


class Scope(enum.StrEnum):
    GLOBAL = "global"
    OWNER_PRIVATE = "owner-private"
    USER_PRIVATE = "user-private"
    AGENT_PRIVATE = "agent-private"


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

PLAIN, MARKDOWN, PDF = "text/plain", "text/markdown", "application/pdf"
EXTENSIONS = {".txt": PLAIN, ".text": PLAIN, ".md": MARKDOWN, ".markdown": MARKDOWN, ".pdf": PDF}
CONTENT_TYPES = frozenset({PLAIN, MARKDOWN, PDF})


@dataclass(frozen=True)
class Requester:
    """Who asks: an entity of the agent, or the operator (who acts as OWNER)."""

    entity_id: uuid.UUID | None
    operator: bool = False

    def params(self) -> dict[str, Any]:
        return {"requester": self.entity_id, "operator": self.operator}


@dataclass(frozen=True)
class Fragment:
    document_id: uuid.UUID
    position: int
    text: str
    title: str
    similarity: float


# -- validation (before any read) -------------------------------------------------------------------


def parse_uuid(value: str, field: str) -> uuid.UUID:
    try:
        return uuid.UUID(value)
    except ValueError:
        raise InvalidArgument(f"{field} must be a UUID, got {value[:60]!r}", code="INVALID_ID") from None


def requester_of(message: documents_pb2.Requester) -> Requester:
    if message.operator:
        if message.entity_id:
            raise InvalidArgument(
                "requester is either the operator or an entity, not both", code="INVALID_REQUESTER"
            )
        return Requester(None, operator=True)
    if not message.entity_id:
        raise InvalidArgument(
            "requester.entity_id is required (or requester.operator for the operator)",
            code="REQUESTER_REQUIRED",
            hint="name the entity the request is made for, so its read and change rules apply",
        )
    return Requester(parse_uuid(message.entity_id, "requester.entity_id"))


def grants_of(values: Sequence[str]) -> list[uuid.UUID]:
    """Direct grants: at most 1000 unique entity UUIDs. Anything else fails closed."""
    if len(values) > MAX_GRANTS:
        raise InvalidArgument(
            f"direct_grant_entity_ids has {len(values)} entries; at most {MAX_GRANTS} are allowed",
            code="TOO_MANY_GRANTS",
        )
    grants = [parse_uuid(v, "direct_grant_entity_ids") for v in values]
    if len(set(grants)) != len(grants):
        raise InvalidArgument("direct_grant_entity_ids has duplicates", code="DUPLICATE_GRANTS")
    return grants


def search_limit(value: int) -> int:
    limit = value or DEFAULT_SEARCH_LIMIT
    if not 1 <= limit <= MAX_SEARCH_LIMIT:
        raise InvalidArgument(
            f"limit must be an integer from 1 to {MAX_SEARCH_LIMIT}, got {value}", code="INVALID_LIMIT"
        )
    return limit


# -- extraction and chunking -------------------------------------------------------------------------


def content_type_of(content_type: str, file_name: str) -> str:
    kind = content_type.split(";")[0].strip().lower()
    if not kind and file_name:
        kind = EXTENSIONS.get(PurePath(file_name).suffix.lower(), "")
    if kind == "text/x-markdown":
        kind = MARKDOWN
    if kind not in CONTENT_TYPES:
        raise InvalidArgument(
            f"content_type {kind or '(none)'!r} is not supported",
            code="UNSUPPORTED_CONTENT_TYPE",
            hint="use text/plain, text/markdown or application/pdf (or a .txt, .md or .pdf file name)",
        )
    return kind


def pdf_text(content: bytes) -> str:
    """The text of a PDF's pages, one page per paragraph. pypdf is imported here: only PDFs need it."""
    import pypdf
    from pypdf.errors import PyPdfError

    # pypdf reports recoverable oddities of a file through logging; they are not ours to show.
    logging.getLogger("pypdf").setLevel(logging.ERROR)
    try:
        reader = pypdf.PdfReader(io.BytesIO(content))
        if reader.is_encrypted:
            raise InvalidArgument("the PDF is encrypted", code="PDF_ENCRYPTED", hint="add a decrypted copy")
        if len(reader.pages) > MAX_PDF_PAGES:
            raise InvalidArgument(f"the PDF has over {MAX_PDF_PAGES} pages", code="PDF_TOO_LARGE")
        pages = [page.extract_text() or "" for page in reader.pages]
    except (PyPdfError, ValueError, KeyError, TypeError, AttributeError, IndexError) as exc:
        raise InvalidArgument(
            f"the file is not a readable PDF ({type(exc).__name__})", code="PDF_UNREADABLE"
        ) from exc
    return "\n\n".join(p.strip() for p in pages if p.strip())


def extract(text: str, content: bytes, content_type: str, file_name: str) -> tuple[str, str, int]:
    """(text, content type, size in bytes) of what was given: text, or a file's bytes."""
    if bool(text) == bool(content):
        raise InvalidArgument("give exactly one of text and content", code="DOCUMENT_CONTENT_REQUIRED")
    if text:
        kind = content_type_of(content_type, file_name) if (content_type or file_name) else PLAIN
        if kind == PDF:
            raise InvalidArgument("a PDF is sent as content, not text", code="UNSUPPORTED_CONTENT_TYPE")
        size = len(text.encode())
    else:
        if len(content) > MAX_CONTENT_BYTES:
            raise InvalidArgument(f"content is over {MAX_CONTENT_BYTES} bytes", code="DOCUMENT_TOO_LARGE")
        kind = content_type_of(content_type, file_name)
        size = len(content)
        if kind == PDF:
            text = pdf_text(content)
        else:
            try:
                text = content.decode("utf-8-sig")
            except UnicodeDecodeError:
                raise InvalidArgument(
                    "the text file is not UTF-8", code="DOCUMENT_NOT_UTF8", hint="convert it to UTF-8"
                ) from None
    text = text.replace("\x00", "")
    if len(text) > MAX_TEXT_CHARS:
        raise InvalidArgument(
            f"the document's text is over {MAX_TEXT_CHARS} characters", code="DOCUMENT_TOO_LARGE"
        )
    if not text.strip():
        raise InvalidArgument("the document has no text", code="DOCUMENT_EMPTY")
    return text, kind, size


_HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$")
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")


def _split_long(paragraph: str, size: int) -> list[str]:
    """A paragraph over ``size`` characters, cut at sentence ends, else at spaces, else anywhere."""
    pieces: list[str] = []
    current = ""
    for sentence in _SENTENCE_END.split(paragraph):
        for word in sentence.split(" ") if len(sentence) > size else [sentence]:
            while len(word) > size:
                if current:
                    pieces.append(current)
                    current = ""
                pieces.append(word[:size])
                word = word[size:]
            joined = f"{current} {word}" if current else word
            if len(joined) > size:
                pieces.append(current)
                current = word
            else:
                current = joined
    if current:
        pieces.append(current)
    return pieces


def chunk(text: str, content_type: str, size: int = FRAGMENT_CHARS) -> list[str]:
    """Fragments of at most ``size`` characters, packed from whole paragraphs where they fit.

    Markdown is cut at headings too, and every fragment of a section starts with its heading, so
    a fragment found by search still says what it is about.
    """
    sections: list[tuple[str, list[str]]] = [("", [])]
    for block in re.split(r"\n\s*\n", text.replace("\r\n", "\n")):
        lines = [line for line in block.split("\n") if line.strip()]
        if content_type == MARKDOWN:
            rest: list[str] = []
            for line in lines:
                found = _HEADING.match(line.strip())
                if found:
                    if rest:
                        sections[-1][1].append(" ".join(rest))
                        rest = []
                    sections.append((found.group(1), []))
                else:
                    rest.append(line.strip())
            if rest:
                sections[-1][1].append(" ".join(rest))
        elif lines:
            sections[-1][1].append(" ".join(" ".join(line.split()) for line in lines))
    fragments: list[str] = []
    for heading, paragraphs in sections:
        prefix = f"{heading}\n" if heading else ""
        room = max(size - len(prefix), size // 2)
        current = ""
        for paragraph in paragraphs:
            paragraph = " ".join(paragraph.split())
            for piece in _split_long(paragraph, room) if len(paragraph) > room else [paragraph]:
                if current and len(current) + 2 + len(piece) > room:
                    fragments.append(prefix + current)
                    current = piece
                else:
                    current = f"{current}\n\n{piece}" if current else piece
        if current:
            fragments.append(prefix + current)
        elif heading and not paragraphs:
            fragments.append(heading)
    return [f for f in fragments if f.strip()]


# -- storage ------------------------------------------------------------------------------------------


class DocumentStore:
    """The documents' named queries; every one applies the rules of runtime.allowed_documents in SQL."""

    def __init__(self, db: Database) -> None:
        self.db = db

    async def check_add(self, agent_id: uuid.UUID, requester: Requester, values: Mapping[str, Any]) -> Row:
        row = await self.db.fetchone(
            Q["check_add_document"], {"agent_id": agent_id, **requester.params(), **values}, what="check add"
        )
        assert row is not None
        return row

    async def add(
        self,
        agent_id: uuid.UUID,
        requester: Requester,
        values: Mapping[str, Any],
        fragments: Sequence[str],
        embeddings: Sequence[Sequence[float]],
    ) -> Row | None:
        return await self.db.fetchone(
            Q["add_document"],
            {
                "agent_id": agent_id,
                **requester.params(),
                **values,
                "fragments": list(fragments),
                "embeddings": [_vector(e) for e in embeddings],
            },
            what="add document",
        )

    async def page(
        self, agent_id: uuid.UUID, requester: Requester, room_id: uuid.UUID | None, limit: int, offset: int
    ) -> tuple[list[Row], int]:
        rows = await self.db.fetchall(
            Q["list_documents"],
            {
                "agent_id": agent_id,
                **requester.params(),
                "room_id": room_id,
                "limit": limit,
                "offset": offset,
            },
            what="list documents",
        )
        total = int(rows[0]["total"]) if rows else 0
        return [r for r in rows if r["id"] is not None], total

    async def get(
        self, agent_id: uuid.UUID, requester: Requester, document_id: uuid.UUID, include_text: bool
    ) -> Row | None:
        return await self.db.fetchone(
            Q["get_document"],
            {"agent_id": agent_id, **requester.params(), "id": document_id, "include_text": include_text},
            what="get document",
        )

    async def remove(self, agent_id: uuid.UUID, requester: Requester, document_id: uuid.UUID) -> Row:
        row = await self.db.fetchone(
            Q["remove_document"],
            {"agent_id": agent_id, **requester.params(), "id": document_id},
            what="remove document",
        )
        assert row is not None
        return row

    async def replace_grants(
        self,
        agent_id: uuid.UUID,
        requester: Requester,
        document_id: uuid.UUID,
        expected: int,
        grants: Sequence[uuid.UUID],
    ) -> Row:
        row = await self.db.fetchone(
            Q["replace_document_grants"],
            {
                "agent_id": agent_id,
                **requester.params(),
                "id": document_id,
                "expected": expected,
                "grants": list(grants),
            },
            what="replace document grants",
        )
        assert row is not None
        return row

    async def search(
        self,
        agent_id: uuid.UUID,
        requester: Requester,
        embedding: Sequence[float],
        limit: int,
        room_id: uuid.UUID | None = None,
        scopes: Sequence[str] | None = None,
    ) -> list[Fragment]:
        rows = await self.db.fetchall(
            Q["search_document_fragments"],
            {
                "agent_id": agent_id,
                **requester.params(),
                "embedding": _vector(embedding),
                "limit": limit,
                "room_id": room_id,
                "scopes": list(scopes) if scopes is not None else None,
            },
            what="search documents",
        )
        return [
            Fragment(r["document_id"], r["position"], r["text"], r["title"], float(r["similarity"]))
            for r in rows
        ]

    async def has_documents(self, agent_id: uuid.UUID) -> bool:
        row = await self.db.fetchone(Q["has_documents"], {"agent_id": agent_id}, what="has documents")
        return bool(row and row["found"])


async def embed_all(embed: Embed, texts: Sequence[str], agent_id: uuid.UUID) -> list[list[float]]:
    vectors: list[list[float]] = []
    for start in range(0, len(texts), EMBED_BATCH):
        vectors += await embed(texts[start : start + EMBED_BATCH], agent_id)
    return vectors


# -- the API ------------------------------------------------------------------------------------------


def _ts(value: datetime | None) -> Timestamp | None:
    if value is None:
        return None
    ts = Timestamp()
    ts.FromDatetime(value)
    return ts


def document_message(row: Mapping[str, Any]) -> documents_pb2.Document:
    return documents_pb2.Document(
        id=str(row["id"]),
        agent_id=str(row["agent_id"]),
        room_id=str(row["room_id"] or ""),
        scope=SCOPE_TO_PROTO[Scope(row["scope"])],
        scoped_to_entity_id=str(row["scoped_to_entity_id"] or ""),
        direct_grant_entity_ids=[str(g) for g in row["direct_grant_entity_ids"]],
        access_revision=row["access_revision"],
        title=row["title"],
        content_type=row["content_type"],
        fragment_count=row["fragment_count"],
        size_bytes=row["size_bytes"],
        created_by=str(row["created_by"] or ""),
        created_at=_ts(row["created_at"]),
        text=row.get("text") or "",
    )


def _not_found(document_id: uuid.UUID | str) -> NotFound:
    return NotFound(
        f"no document {document_id}",
        code="DOCUMENT_NOT_FOUND",
        hint="list the documents you may read with `parley docs list`",
    )


class DocumentsApi:
    """``parley.v1.Documents``: one async method per RPC, served over gRPC and NATS."""

    def __init__(self, *, store: DocumentStore, directory: AgentDirectory, embed: Embed) -> None:
        self.store = store
        self.directory = directory
        self.embed = embed

    async def _agent(self, ref: str) -> AgentInfo:
        if not ref:
            raise InvalidArgument("agent_id is required (an agent id or name)", code="AGENT_REQUIRED")
        agent = await self.directory.find(ref)
        if agent is None:
            raise NotFound(
                f"no agent {ref[:100]!r}", code="AGENT_NOT_FOUND", hint="list them with `parley agents`"
            )
        return agent

    async def AddDocument(self, request: documents_pb2.AddDocumentRequest) -> documents_pb2.Document:
        requester = requester_of(request.requester)
        if request.scope not in SCOPE_FROM_PROTO:
            raise InvalidArgument(f"scope {request.scope} is not a DocumentScope", code="INVALID_SCOPE")
        scope = SCOPE_FROM_PROTO[request.scope]
        scoped_to = (
            parse_uuid(request.scoped_to_entity_id, "scoped_to_entity_id")
            if request.scoped_to_entity_id
            else None
        )
        if (scope == Scope.USER_PRIVATE) != (scoped_to is not None):
            raise InvalidArgument(
                "scoped_to_entity_id is required for user-private documents and only for them",
                code="INVALID_SCOPED_ENTITY",
            )
        grants = grants_of(request.direct_grant_entity_ids)
        room = parse_uuid(request.room_id, "room_id") if request.room_id else None
        if len(request.title) > MAX_TITLE_CHARS:
            raise InvalidArgument(f"title is over {MAX_TITLE_CHARS} characters", code="TITLE_TOO_LONG")
        if bool(request.text) == bool(request.content):
            raise InvalidArgument("give exactly one of text and content", code="DOCUMENT_CONTENT_REQUIRED")
        agent = await self._agent(request.agent_id)
        values = {"room_id": room, "scope": scope.value, "scoped_to": scoped_to, "grants": grants}
        # Refuse before reading files and embedding; add_document decides again when it writes.
        check = await self.store.check_add(agent.id, requester, values)
        self._refusal(check["allowed"], check["room_found"], check["entities_found"], room)
        # Reading a PDF is CPU work: off the event loop, which turns share.
        text, content_type, size = await asyncio.to_thread(
            extract, request.text, request.content, request.content_type, request.file_name
        )
        title = request.title.strip() or PurePath(request.file_name).name or " ".join(text.split())[:80]
        fragments = await asyncio.to_thread(chunk, text, content_type)
        embeddings = await embed_all(self.embed, fragments, agent.id)
        row = await self.store.add(
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
        if row is None:
            check = await self.store.check_add(agent.id, requester, values)
            self._refusal(check["allowed"], check["room_found"], check["entities_found"], room)
            raise Conflict(
                "the document could not be added; try again", code="DOCUMENT_ADD_RACED", retryable=True
            )
        return document_message(row)

    @staticmethod
    def _refusal(allowed: bool, room_found: bool, entities_found: bool, room: uuid.UUID | None) -> None:
        if not allowed:
            raise PermissionDenied(
                "the requester may not add a document with this scope, room and grants",
                code="DOCUMENT_ADD_DENIED",
                hint="members add user-private documents of their own rooms; the operator adds any",
            )
        if not room_found:
            raise NotFound(f"no room {room} for this agent", code="ROOM_NOT_FOUND")
        if not entities_found:
            raise InvalidArgument(
                "scoped_to_entity_id and every direct grant must be an entity of this agent",
                code="UNKNOWN_ENTITY",
            )

    async def ListDocuments(
        self, request: documents_pb2.ListDocumentsRequest
    ) -> documents_pb2.ListDocumentsResponse:
        requester = requester_of(request.requester)
        page = page_of(request.page if request.HasField("page") else None)
        room = parse_uuid(request.room_id, "room_id") if request.room_id else None
        agent = await self._agent(request.agent_id)
        rows, total = await self.store.page(agent.id, requester, room, page.fetch, page.offset)
        rows, page_response = cut(page, rows)
        return documents_pb2.ListDocumentsResponse(
            documents=[document_message(r) for r in rows], page=page_response, total=total
        )

    async def GetDocument(self, request: documents_pb2.GetDocumentRequest) -> documents_pb2.Document:
        requester = requester_of(request.requester)
        document_id = parse_uuid(request.document_id, "document_id")
        agent = await self._agent(request.agent_id)
        row = await self.store.get(agent.id, requester, document_id, request.include_text)
        if row is None:
            raise _not_found(document_id)
        return document_message(row)

    async def RemoveDocument(
        self, request: documents_pb2.RemoveDocumentRequest
    ) -> documents_pb2.RemoveDocumentResponse:
        requester = requester_of(request.requester)
        document_id = parse_uuid(request.document_id, "document_id")
        agent = await self._agent(request.agent_id)
        row = await self.store.remove(agent.id, requester, document_id)
        if row["fragments_removed"] is not None:
            return documents_pb2.RemoveDocumentResponse(
                document_id=str(document_id), fragments_removed=row["fragments_removed"]
            )
        if not row["readable"] or await self.store.get(agent.id, requester, document_id, False) is None:
            # Not readable; or readable, and removed meanwhile by a concurrent request.
            raise _not_found(document_id)
        raise PermissionDenied(
            f"the requester may not remove document {document_id}",
            code="DOCUMENT_CHANGE_DENIED",
            hint="grants give reading only; ask an OWNER",
        )

    async def ReplaceDocumentGrants(
        self, request: documents_pb2.ReplaceDocumentGrantsRequest
    ) -> documents_pb2.Document:
        requester = requester_of(request.requester)
        document_id = parse_uuid(request.document_id, "document_id")
        grants = grants_of(request.direct_grant_entity_ids)
        if request.expected_access_revision < 1:
            raise InvalidArgument(
                "expected_access_revision is required (the document's access_revision)",
                code="REVISION_REQUIRED",
                hint="read it with GetDocument (`parley docs show`)",
            )
        agent = await self._agent(request.agent_id)
        row = await self.store.replace_grants(
            agent.id, requester, document_id, request.expected_access_revision, grants
        )
        if row["id"] is not None:
            return document_message(row)
        if not row["readable"]:
            raise _not_found(document_id)
        if not row["may_grant"]:
            raise PermissionDenied(
                f"the requester may not replace the grants of document {document_id}",
                code="DOCUMENT_GRANT_DENIED",
                hint="the OWNER may; an ADMIN of the document's room may for global and user-private ones",
            )
        if not row["entities_found"]:
            raise InvalidArgument("every direct grant must be an entity of this agent", code="UNKNOWN_ENTITY")
        current = row["current_revision"]
        if current == request.expected_access_revision:
            # The statement read the revision before a concurrent replacement committed.
            current = (await self.store.get(agent.id, requester, document_id, False) or {}).get(
                "access_revision"
            )
        raise Conflict(
            f"document {document_id} has access revision {current}, not {request.expected_access_revision}",
            code="ACCESS_REVISION_CHANGED",
            hint="read the document again and retry with its access_revision",
        )

    async def SearchDocuments(
        self, request: documents_pb2.SearchDocumentsRequest
    ) -> documents_pb2.SearchDocumentsResponse:
        requester = requester_of(request.requester)
        limit = search_limit(request.limit)
        if not request.query.strip():
            raise InvalidArgument("query must not be empty", code="QUERY_REQUIRED")
        room = parse_uuid(request.room_id, "room_id") if request.room_id else None
        agent = await self._agent(request.agent_id)
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


# -- the KNOWLEDGE provider -------------------------------------------------------------------------


async def knowledge(ctx: TurnContext) -> ProviderResult:
    """Fragments of the documents the message's sender may read that relate to the message.

    The search is made as the sender, so the rules of the sender's roles apply in SQL like for any
    requester.
    """
    hits = await ctx.services.search_documents(ctx.message.text, limit=PROVIDER_FRAGMENTS)
    if not hits:
        return ProviderResult()
    lines = [f"- ({h.title}) {' '.join(h.text.split())}" for h in hits]
    return ProviderResult(
        "# Knowledge\n" + "\n".join(lines),
        data={"knowledge": [f"{h.document_id}:{h.position}" for h in hits]},
    )
