"""`parley docs add|list|show|remove|grant|search`: an agent's documents (knowledge), as the operator.

The operator acts as OWNER: every document is visible and may be changed. The runtime serves the
``parley.v1.Documents`` API beside its own.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Annotated, Literal

import typer

from parley.v1 import common_pb2, documents_pb2, documents_pb2_grpc
from parley_platform.errors import InvalidArgument

from . import client, common
from .common import Agent, Json, Room, command

app = common.group("docs", "An agent's documents (knowledge), searched by meaning.")
call = client.caller("runtime", documents_pb2_grpc.DocumentsStub, timeout=120.0)
OPERATOR = documents_pb2.Requester(operator=True)
SCOPES = {
    "global": documents_pb2.DOCUMENT_SCOPE_GLOBAL,
    "owner-private": documents_pb2.DOCUMENT_SCOPE_OWNER_PRIVATE,
    "user-private": documents_pb2.DOCUMENT_SCOPE_USER_PRIVATE,
    "agent-private": documents_pb2.DOCUMENT_SCOPE_AGENT_PRIVATE,
}
SCOPE_NAMES = {value: name for name, value in SCOPES.items()}
MAX_FILE_BYTES = 3 * 1024 * 1024

DocumentId = Annotated[str, typer.Argument(metavar="DOC_ID", help="the document's id")]


def _describe(doc: documents_pb2.Document) -> str:
    scope = SCOPE_NAMES.get(doc.scope, "?")
    return (
        f"{doc.id}  {scope:<13} {doc.fragment_count:>4} fragments  {common.when(doc.created_at)}  {doc.title}"
    )


def _read_file(path: Path) -> bytes | None:
    """The file's bytes, or None when SOURCE names no file (it is then the text itself)."""
    if not path.is_file():
        return None
    if path.stat().st_size > MAX_FILE_BYTES:
        raise InvalidArgument(f"{path} is over {MAX_FILE_BYTES} bytes", code="DOCUMENT_TOO_LARGE")
    return path.read_bytes()


@command(app)
async def add(
    source: str = typer.Argument(..., metavar="SOURCE", help="a file path, or the text itself"),
    agent: Agent = "default",
    text: bool = typer.Option(False, "--text", help="take SOURCE as text even if a file has that name"),
    title: str = typer.Option("", metavar="TITLE", help="default: the file name or the text's beginning"),
    room: str = typer.Option("", metavar="ROOM_ID", help="the room it belongs to (its room entitlement)"),
    scope: Literal["agent-private", "global", "owner-private", "user-private"] = typer.Option("global"),
    scoped_to: str = typer.Option("", metavar="ENTITY_ID", help="whom a user-private document belongs to"),
    grant: list[str] | None = typer.Option(None, metavar="ENTITY_ID", help="a direct grant (repeatable)"),
    content_type: str = typer.Option("", metavar="TYPE", help="text/plain, text/markdown or application/pdf"),
    json: Json = False,
) -> None:
    """Add a document: a .txt, .md or .pdf file, or text.

    It is cut into fragments, which search and the agent's KNOWLEDGE provider find by meaning."""
    request = documents_pb2.AddDocumentRequest(
        agent_id=agent,
        requester=OPERATOR,
        room_id=room,
        scope=SCOPES[scope],
        scoped_to_entity_id=scoped_to,
        direct_grant_entity_ids=grant or [],
        title=title,
        content_type=content_type,
    )
    content = None if text else await asyncio.to_thread(_read_file, Path(source))
    if content is None:
        request.text = source
    else:
        request.content = content
        request.file_name = Path(source).name
    doc = await call("AddDocument", request)
    common.emit(json, doc, f"added: {_describe(doc)}")


@command(app, "list")
async def list_documents(
    agent: Agent = "default",
    room: Room = "",
    limit: int = typer.Option(0, metavar="N", help="1 to 100 (default 50)", show_default=False),
    offset: int = typer.Option(0, metavar="N", help="0 or more"),
    json: Json = False,
) -> None:
    """Documents, newest first, and how many there are in all."""
    page = common_pb2.PageRequest(limit=limit, offset=offset)
    reply = await call(
        "ListDocuments",
        documents_pb2.ListDocumentsRequest(agent_id=agent, requester=OPERATOR, room_id=room, page=page),
    )
    if json:
        common.print_json(reply)
        return
    for doc in reply.documents:
        print(_describe(doc))
    if not reply.documents:
        print("(none)")
    print(f"{reply.total} in all")
    if reply.page.has_more:
        print(f"more: --offset {reply.page.next_offset}")


@command(app)
async def show(
    id: DocumentId,
    agent: Agent = "default",
    text: bool = typer.Option(False, "--text", help="print its text too"),
    json: Json = False,
) -> None:
    """One document: its scope, room, grants and revision."""
    request = documents_pb2.GetDocumentRequest(
        agent_id=agent, requester=OPERATOR, document_id=id, include_text=text
    )
    doc = await call("GetDocument", request)
    if json:
        common.print_json(doc)
        return
    print(_describe(doc))
    print(f"content type: {doc.content_type}, {doc.size_bytes} bytes, access revision {doc.access_revision}")
    print(f"room: {doc.room_id or '(none)'}")
    if doc.scoped_to_entity_id:
        print(f"scoped to: {doc.scoped_to_entity_id}")
    print(f"direct grants: {', '.join(doc.direct_grant_entity_ids) or '(none)'}")
    if text:
        print()
        print(doc.text)


@command(app)
async def remove(id: DocumentId, agent: Agent = "default", json: Json = False) -> None:
    """Remove a document and its fragments."""
    request = documents_pb2.RemoveDocumentRequest(agent_id=agent, requester=OPERATOR, document_id=id)
    reply = await call("RemoveDocument", request)
    common.emit(json, reply, f"removed: {reply.document_id} ({reply.fragments_removed} fragments)")


@command(app)
async def grant(
    id: DocumentId,
    revision: int = typer.Option(..., metavar="N", help="its access revision (see `parley docs show`)"),
    entity: list[str] | None = typer.Option(
        None, metavar="ENTITY_ID", help="a grantee (repeatable; none: no grants)"
    ),
    agent: Agent = "default",
    json: Json = False,
) -> None:
    """Replace a document's direct grants.

    Direct grants name who may read it besides those its scope and room allow."""
    request = documents_pb2.ReplaceDocumentGrantsRequest(
        agent_id=agent,
        requester=OPERATOR,
        document_id=id,
        expected_access_revision=revision,
        direct_grant_entity_ids=entity or [],
    )
    doc = await call("ReplaceDocumentGrants", request)
    grants = len(doc.direct_grant_entity_ids)
    common.emit(json, doc, f"grants replaced: {grants} entities, access revision {doc.access_revision}")


@command(app)
async def search(
    query: str = typer.Argument(..., metavar="QUERY"),
    agent: Agent = "default",
    room: Room = "",
    limit: int = typer.Option(10, metavar="N", help="1 to 100"),
    json: Json = False,
) -> None:
    """The fragments nearest in meaning to a query.

    Best first, one a line: similarity, title #position: text."""
    request = documents_pb2.SearchDocumentsRequest(
        agent_id=agent, requester=OPERATOR, query=query, limit=limit, room_id=room
    )
    reply = await call("SearchDocuments", request)
    if json:
        common.print_json(reply)
        return
    for f in reply.fragments:
        print(f"{f.similarity:.3f}  {f.title} #{f.position}: {' '.join(f.text.split())[:200]}")
    if not reply.fragments:
        print("(none)")
