"""Documents (knowledge): what a document is, the checks on what is sent, and how text is extracted
and cut into fragments.

Who may read, change or re-grant a document is decided in SQL by ``runtime.allowed_documents`` and
``runtime.document_rule`` (see ``sql/schema.sql``), inside every statement that makes rows, counts,
fragments or rankings; this module only validates input, extracts and chunks text, embeds it and
maps results to messages. A document the requester may not read is NOT_FOUND exactly like a
missing one.
"""

from __future__ import annotations

import enum
import io
import logging
import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import PurePath
from typing import Any

from parley_platform.convert import uuid_of

from .. import errors

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


@dataclass(frozen=True)
class Document:
    id: uuid.UUID
    agent_id: uuid.UUID
    room_id: uuid.UUID | None
    scope: Scope
    scoped_to_entity_id: uuid.UUID | None
    direct_grant_entity_ids: tuple[uuid.UUID, ...]
    access_revision: int
    title: str
    content_type: str
    fragment_count: int
    size_bytes: int
    created_by: uuid.UUID | None
    created_at: datetime
    text: str = ""

    @classmethod
    def from_row(cls, row: dict[str, Any]) -> Document:
        return cls(
            id=row["id"],
            agent_id=row["agent_id"],
            room_id=row["room_id"],
            scope=Scope(row["scope"]),
            scoped_to_entity_id=row["scoped_to_entity_id"],
            direct_grant_entity_ids=tuple(row["direct_grant_entity_ids"]),
            access_revision=row["access_revision"],
            title=row["title"],
            content_type=row["content_type"],
            fragment_count=row["fragment_count"],
            size_bytes=row["size_bytes"],
            created_by=row["created_by"],
            created_at=row["created_at"],
            text=row.get("text") or "",
        )


@dataclass(frozen=True)
class AddCheck:
    """Whether the requester may add a document with these values, decided by the SQL rules."""

    allowed: bool
    room_found: bool
    entities_found: bool


@dataclass(frozen=True)
class Removal:
    fragments_removed: int | None  # None: nothing was removed
    readable: bool


@dataclass(frozen=True)
class GrantReplacement:
    document: Document | None  # None: nothing was replaced; the flags say why
    readable: bool
    may_grant: bool
    entities_found: bool
    current_revision: int | None


# -- validation (before any read) -------------------------------------------------------------------


def grants_of(values: Sequence[str]) -> list[uuid.UUID]:
    """Direct grants: at most 1000 unique entity UUIDs. Anything else fails closed."""
    if len(values) > MAX_GRANTS:
        raise errors.TOO_MANY_GRANTS(
            f"direct_grant_entity_ids has {len(values)} entries; at most {MAX_GRANTS} are allowed"
        )
    grants = [uuid_of(v, "direct_grant_entity_ids") for v in values]
    if len(set(grants)) != len(grants):
        raise errors.DUPLICATE_GRANTS("direct_grant_entity_ids has duplicates")
    return grants


def search_limit(value: int) -> int:
    limit = value or DEFAULT_SEARCH_LIMIT
    if not 1 <= limit <= MAX_SEARCH_LIMIT:
        raise errors.INVALID_LIMIT(f"limit must be an integer from 1 to {MAX_SEARCH_LIMIT}, got {value}")
    return limit


# -- extraction and chunking -------------------------------------------------------------------------


def content_type_of(content_type: str, file_name: str) -> str:
    kind = content_type.split(";")[0].strip().lower()
    if not kind and file_name:
        kind = EXTENSIONS.get(PurePath(file_name).suffix.lower(), "")
    if kind == "text/x-markdown":
        kind = MARKDOWN
    if kind not in CONTENT_TYPES:
        raise errors.UNSUPPORTED_CONTENT_TYPE(f"content_type {kind or '(none)'!r} is not supported")
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
            raise errors.PDF_ENCRYPTED("the PDF is encrypted")
        if len(reader.pages) > MAX_PDF_PAGES:
            raise errors.PDF_TOO_LARGE(f"the PDF has over {MAX_PDF_PAGES} pages")
        pages = [page.extract_text() or "" for page in reader.pages]
    except (PyPdfError, ValueError, KeyError, TypeError, AttributeError, IndexError) as exc:
        raise errors.PDF_UNREADABLE(f"the file is not a readable PDF ({type(exc).__name__})") from exc
    return "\n\n".join(p.strip() for p in pages if p.strip())


def extract(text: str, content: bytes, content_type: str, file_name: str) -> tuple[str, str, int]:
    """(text, content type, size in bytes) of what was given: text, or a file's bytes."""
    if bool(text) == bool(content):
        raise errors.DOCUMENT_CONTENT_REQUIRED("give exactly one of text and content")
    if text:
        kind = content_type_of(content_type, file_name) if (content_type or file_name) else PLAIN
        if kind == PDF:
            raise errors.UNSUPPORTED_CONTENT_TYPE("a PDF is sent as content, not text")
        size = len(text.encode())
    else:
        if len(content) > MAX_CONTENT_BYTES:
            raise errors.DOCUMENT_TOO_LARGE(f"content is over {MAX_CONTENT_BYTES} bytes")
        kind = content_type_of(content_type, file_name)
        size = len(content)
        if kind == PDF:
            text = pdf_text(content)
        else:
            try:
                text = content.decode("utf-8-sig")
            except UnicodeDecodeError:
                raise errors.DOCUMENT_NOT_UTF8("the text file is not UTF-8") from None
    text = text.replace("\x00", "")
    if len(text) > MAX_TEXT_CHARS:
        raise errors.DOCUMENT_TOO_LARGE(f"the document's text is over {MAX_TEXT_CHARS} characters")
    if not text.strip():
        raise errors.DOCUMENT_EMPTY("the document has no text")
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
