"""`parley docs add|list|show|remove|grant|search`: an agent's documents (knowledge), as the operator.

The operator acts as OWNER: every document is visible and may be changed. The runtime serves the
``parley.v1.Documents`` API beside its own.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

from google.protobuf.json_format import MessageToDict

from parley.v1 import common_pb2, documents_pb2, documents_pb2_grpc
from parley_platform.errors import InvalidArgument

from . import client

SERVICE = "runtime"
OPERATOR = documents_pb2.Requester(operator=True)
SCOPES = {
    "global": documents_pb2.DOCUMENT_SCOPE_GLOBAL,
    "owner-private": documents_pb2.DOCUMENT_SCOPE_OWNER_PRIVATE,
    "user-private": documents_pb2.DOCUMENT_SCOPE_USER_PRIVATE,
    "agent-private": documents_pb2.DOCUMENT_SCOPE_AGENT_PRIVATE,
}
SCOPE_NAMES = {value: name for name, value in SCOPES.items()}
MAX_FILE_BYTES = 3 * 1024 * 1024


async def _call(method_name: str, request: Any) -> Any:
    async with client.service_stub(SERVICE, documents_pb2_grpc.DocumentsStub) as (stub, metadata):
        return await client.call(getattr(stub, method_name), request, metadata, timeout=120.0)


def _int(value: str | None, name: str, default: int) -> int:
    if value is None:
        return default
    try:
        return int(value)
    except ValueError:
        raise InvalidArgument(f"--{name} must be an integer, got {value!r}", code="INVALID_PAGE") from None


def _describe(doc: documents_pb2.Document) -> str:
    when = doc.created_at.ToDatetime().strftime("%Y-%m-%d %H:%M:%S") if doc.created_at.seconds else "-"
    scope = SCOPE_NAMES.get(doc.scope, "?")
    return f"{doc.id}  {scope:<13} {doc.fragment_count:>4} fragments  {when}  {doc.title}"


def _as_json(message: Any) -> str:
    return json.dumps(MessageToDict(message, preserving_proto_field_name=True), indent=2)


def _read_file(path: Path) -> bytes | None:
    """The file's bytes, or None when SOURCE names no file (it is then the text itself)."""
    if not path.is_file():
        return None
    if path.stat().st_size > MAX_FILE_BYTES:
        raise InvalidArgument(f"{path} is over {MAX_FILE_BYTES} bytes", code="DOCUMENT_TOO_LARGE")
    return path.read_bytes()


async def cmd_add(args: argparse.Namespace) -> int:
    request = documents_pb2.AddDocumentRequest(
        agent_id=args.agent,
        requester=OPERATOR,
        room_id=args.room or "",
        scope=SCOPES[args.scope],
        scoped_to_entity_id=args.scoped_to or "",
        direct_grant_entity_ids=args.grant or [],
        title=args.title or "",
        content_type=args.content_type or "",
    )
    content = None if args.text else await asyncio.to_thread(_read_file, Path(args.source))
    if content is None:
        request.text = args.source
    else:
        request.content = content
        request.file_name = Path(args.source).name
    doc = await _call("AddDocument", request)
    print(_as_json(doc) if args.json else f"added: {_describe(doc)}")
    return 0


async def cmd_list(args: argparse.Namespace) -> int:
    page = common_pb2.PageRequest(limit=_int(args.limit, "limit", 0), offset=_int(args.offset, "offset", 0))
    reply = await _call(
        "ListDocuments",
        documents_pb2.ListDocumentsRequest(
            agent_id=args.agent, requester=OPERATOR, room_id=args.room or "", page=page
        ),
    )
    if args.json:
        print(_as_json(reply))
        return 0
    for doc in reply.documents:
        print(_describe(doc))
    if not reply.documents:
        print("(none)")
    print(f"{reply.total} in all")
    if reply.page.has_more:
        print(f"more: --offset {reply.page.next_offset}")
    return 0


async def cmd_show(args: argparse.Namespace) -> int:
    doc = await _call(
        "GetDocument",
        documents_pb2.GetDocumentRequest(
            agent_id=args.agent, requester=OPERATOR, document_id=args.id, include_text=args.text
        ),
    )
    if args.json:
        print(_as_json(doc))
        return 0
    print(_describe(doc))
    print(f"content type: {doc.content_type}, {doc.size_bytes} bytes, access revision {doc.access_revision}")
    print(f"room: {doc.room_id or '(none)'}")
    if doc.scoped_to_entity_id:
        print(f"scoped to: {doc.scoped_to_entity_id}")
    print(f"direct grants: {', '.join(doc.direct_grant_entity_ids) or '(none)'}")
    if args.text:
        print()
        print(doc.text)
    return 0


async def cmd_remove(args: argparse.Namespace) -> int:
    reply = await _call(
        "RemoveDocument",
        documents_pb2.RemoveDocumentRequest(agent_id=args.agent, requester=OPERATOR, document_id=args.id),
    )
    print(f"removed: {reply.document_id} ({reply.fragments_removed} fragments)")
    return 0


async def cmd_grant(args: argparse.Namespace) -> int:
    doc = await _call(
        "ReplaceDocumentGrants",
        documents_pb2.ReplaceDocumentGrantsRequest(
            agent_id=args.agent,
            requester=OPERATOR,
            document_id=args.id,
            expected_access_revision=args.revision,
            direct_grant_entity_ids=args.entity or [],
        ),
    )
    print(
        f"grants replaced: {len(doc.direct_grant_entity_ids)} entities, access revision {doc.access_revision}"
    )
    return 0


async def cmd_search(args: argparse.Namespace) -> int:
    reply = await _call(
        "SearchDocuments",
        documents_pb2.SearchDocumentsRequest(
            agent_id=args.agent,
            requester=OPERATOR,
            query=args.query,
            limit=args.limit,
            room_id=args.room or "",
        ),
    )
    for f in reply.fragments:
        print(f"{f.similarity:.3f}  {f.title} #{f.position}: {' '.join(f.text.split())[:200]}")
    if not reply.fragments:
        print("(none)")
    return 0


def register(subparsers: Any) -> None:
    docs = subparsers.add_parser("docs", help="an agent's documents (knowledge): add, list, show, remove")
    sub = docs.add_subparsers(dest="docs_command", required=True)

    def command(
        name: str, help_text: str, handler: Callable[[argparse.Namespace], Coroutine[Any, Any, int]]
    ) -> argparse.ArgumentParser:
        p: argparse.ArgumentParser = sub.add_parser(name, help=help_text)
        p.add_argument("--agent", default="default", help="agent name or id (default: default)")
        p.add_argument("--json", action="store_true", help="print the answer as JSON")
        p.set_defaults(coro=handler)
        return p

    p = command("add", "add a document: text, or a .txt, .md or .pdf file", cmd_add)
    p.add_argument("source", help="a file path, or the text itself")
    p.add_argument("--text", action="store_true", help="take SOURCE as text even if a file has that name")
    p.add_argument("--title", help="default: the file name or the text's beginning")
    p.add_argument("--room", help="the room id the document belongs to (its room entitlement)")
    p.add_argument("--scope", choices=sorted(SCOPES), default="global", help="default: global")
    p.add_argument("--scoped-to", help="the entity id a user-private document belongs to")
    p.add_argument("--grant", action="append", metavar="ENTITY_ID", help="a direct grant (repeatable)")
    p.add_argument(
        "--content-type", help="text/plain, text/markdown or application/pdf (default: by extension)"
    )
    p = command("list", "documents, newest first", cmd_list)
    p.add_argument("--room", help="only this room's documents")
    p.add_argument("--limit", help="1 to 100 (default 50)")
    p.add_argument("--offset", help="0 or more (default 0)")
    p = command("show", "one document", cmd_show)
    p.add_argument("id")
    p.add_argument("--text", action="store_true", help="print its text too")
    p = command("remove", "remove a document and its fragments", cmd_remove)
    p.add_argument("id")
    p = command("grant", "replace a document's direct grants", cmd_grant)
    p.add_argument("id")
    p.add_argument("--revision", type=int, required=True, help="its access revision (see `parley docs show`)")
    p.add_argument(
        "--entity",
        action="append",
        metavar="ENTITY_ID",
        help="a grantee (repeatable; none: remove every grant)",
    )
    p = command("search", "fragments nearest to a query", cmd_search)
    p.add_argument("query")
    p.add_argument("--room", help="only this room's documents")
    p.add_argument("--limit", type=int, default=10, help="1 to 100 (default 10)")
