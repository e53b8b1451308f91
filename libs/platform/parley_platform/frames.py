"""The envelope of the RPCs over NATS (``rpc``, ``rpcstream``): a few bytes in front of the
protobuf message, not a NATS header block.

A header block costs every request and every reply a text encoding on one side and a parse on
the other; these are fixed-size binary fields.

Request: ``0xB1``, a flags byte (``BATCH``: the caller takes batched stream items; ``LAST``: it
also takes a stream's last items and its end in one message, see ``rpcstream``), the caller's
deadline in milliseconds since the epoch (8 bytes, big-endian; 0: none), the stream id's length
(one byte; 0 for a unary call) and the stream id (ASCII), then the request message.

Reply (and each message of a stream): one status byte (``OK``, ``ERROR``, and for streams
``OPEN``, ``ITEMS``, ``END``, ``LAST``), then the response, a ``parley.v1.Error``, or nothing.

A reply's status byte 0–5 is never the first byte of a protobuf message (a field's tag, and
field number 0 does not exist), so a reply in no envelope is told apart for certain
(``BAD_REPLY``). A bare protobuf request is told apart unless it happens to begin with ``0xB1``
(field 22 as a fixed64) and the bytes after it read as the envelope's fields; otherwise the
server answers ``INVALID_PAYLOAD`` saying what it expected, rather than misreading it.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

MAGIC = 0xB1
BATCH = 0x01
LAST = 0x02
_HEAD = struct.Struct(">BBQB")  # magic, flags, deadline (ms), stream id length

OK, ERROR, OPEN, ITEMS, END, LAST_ITEMS = 0, 1, 2, 3, 4, 5
STATUS_NAMES = {OK: "ok", ERROR: "error", OPEN: "open", ITEMS: "items", END: "end", LAST_ITEMS: "last"}
_STATUS_BYTES = [bytes([status]) for status in range(len(STATUS_NAMES))]


class FrameError(ValueError):
    """The bytes are not in this envelope."""


@dataclass(slots=True)  # not frozen: one per request, and a frozen __init__ costs three times as much
class Request:
    deadline: float | None  # epoch seconds
    stream_id: str
    batch: bool
    body: bytes
    last: bool = False


def request(
    body: bytes, *, deadline: float | None, stream_id: str = "", batch: bool = False, last: bool = False
) -> bytes:
    sid = stream_id.encode("ascii")
    millis = 0 if deadline is None else max(1, round(deadline * 1000))
    flags = (BATCH if batch else 0) | (LAST if last else 0)
    return _HEAD.pack(MAGIC, flags, millis, len(sid)) + sid + body


def parse_request(data: bytes) -> Request:
    try:
        magic, flags, millis, sid_length = _HEAD.unpack_from(data)
    except struct.error as exc:
        raise FrameError("shorter than the request envelope") from exc
    if magic != MAGIC:
        raise FrameError("not in the request envelope (parley_platform.frames)")
    start = _HEAD.size + sid_length
    if len(data) < start:
        raise FrameError("the stream id runs past the end")
    try:
        stream_id = data[_HEAD.size : start].decode("ascii")
    except UnicodeDecodeError as exc:
        raise FrameError("the stream id is not ASCII") from exc
    return Request(
        millis / 1000 if millis else None, stream_id, bool(flags & BATCH), data[start:], bool(flags & LAST)
    )


def reply(status: int, body: bytes = b"") -> bytes:
    return _STATUS_BYTES[status] + body


def parse_reply(data: bytes) -> tuple[int, bytes]:
    """(status, body); ``FrameError`` when the first byte is no status."""
    if not data or data[0] not in STATUS_NAMES:
        raise FrameError("not in the reply envelope (parley_platform.frames)")
    return data[0], data[1:]
