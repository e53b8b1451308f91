"""One reply, one platform message: streamed by editing it, finished from the durable reply.

A chat platform's connector (Telegram, Slack) shows an agent's answer as one message. Stream chunks
(best effort, core NATS) create it and edit it, at most once per ``edit_interval`` seconds; the
durable reply (the OUTBOUND stream, delivered once per connector) sets its final text, so a chunk
lost on the way cannot leave a wrong final message. A turn that ends superseded or cancelled deletes
what it had streamed. Which reply became which platform message is kept in a ``Ledger`` (SQLite,
on disk) before the reply is acknowledged, so a reply delivered again — after a restart, or twice —
edits or skips that message instead of sending another.
"""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from parley_platform.logging import get_logger

log = get_logger(__name__)


class PlatformError(Exception):
    """A platform API call failed (the message is the platform's reason, never a token).
    ``gone``: the message it named no longer exists (deleted by someone); otherwise the failure may
    pass (a rate limit, an outage) and the call is worth repeating later."""

    def __init__(self, reason: str, *, gone: bool = False) -> None:
        super().__init__(reason)
        self.gone = gone


class ChatPlatform(Protocol):
    """What the delivery needs from a platform: send, edit and delete one message of a channel."""

    limit: int  # the longest message text the platform takes

    async def send(self, channel_id: str, in_reply_to: str, text: str) -> str:
        """Send ``text`` in ``channel_id`` (answering ``in_reply_to``); returns the message's handle."""
        ...

    async def edit(self, channel_id: str, handle: str, text: str) -> None: ...

    async def delete(self, channel_id: str, handle: str) -> None: ...


@dataclass(frozen=True)
class Entry:
    channel_id: str
    handle: str
    final: bool


class Ledger:
    """response_id → the platform message showing it, and whether its final text is there."""

    def __init__(self, path: Path | None) -> None:
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(str(path) if path is not None else ":memory:")
        # WAL without a sync per commit: an entry survives the process being killed (it is in the
        # OS's cache), and a commit does not stall the event loop on the disk.
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.execute(
            "CREATE TABLE IF NOT EXISTS sent (response_id TEXT PRIMARY KEY, channel_id TEXT NOT NULL,"
            " handle TEXT NOT NULL, final INTEGER NOT NULL, at REAL NOT NULL)"
        )
        self._db.commit()

    def get(self, response_id: str) -> Entry | None:
        row = self._db.execute(
            "SELECT channel_id, handle, final FROM sent WHERE response_id = ?", (response_id,)
        ).fetchone()
        return None if row is None else Entry(row[0], row[1], bool(row[2]))

    def put(self, response_id: str, entry: Entry) -> None:
        self._db.execute(
            "INSERT OR REPLACE INTO sent VALUES (?, ?, ?, ?, ?)",
            (response_id, entry.channel_id, entry.handle, int(entry.final), time.time()),
        )
        self._db.commit()

    def forget_older_than(self, seconds: float) -> None:
        self._db.execute("DELETE FROM sent WHERE at < ?", (time.time() - seconds,))
        self._db.commit()

    def close(self) -> None:
        self._db.close()


@dataclass
class _Draft:
    """A reply being streamed: the text so far and the message showing it."""

    channel_id: str
    in_reply_to: str
    text: str = ""
    next_sequence: int = 1
    handle: str = ""
    shown: str = ""
    broken: bool = False  # a chunk was lost: stop editing, the durable reply will set the text
    last_edit: float = 0.0
    flush: asyncio.Task[None] | None = None
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


def fit(text: str, limit: int) -> str:
    """The text cut to the platform's limit (an ellipsis marks the cut)."""
    return text if len(text) <= limit else text[: limit - 1] + "…"


@dataclass
class Counts:
    sent: int = 0
    edited: int = 0
    deleted: int = 0
    duplicates: int = 0


class Delivery:
    def __init__(self, platform: ChatPlatform, ledger: Ledger, *, edit_interval: float = 1.0) -> None:
        self.platform = platform
        self.ledger = ledger
        self.edit_interval = edit_interval
        self.counts = Counts()
        self._drafts: dict[str, _Draft] = {}

    async def chunk(
        self,
        response_id: str,
        channel_id: str,
        in_reply_to: str,
        sequence: int,
        delta: str,
        *,
        final: bool = False,
        outcome: str = "",
    ) -> None:
        """A stream chunk: show the text so far, creating the message on the first visible text."""
        done = self.ledger.get(response_id)
        if done is not None and done.final:
            return  # the durable reply came first: late chunks change nothing
        draft = self._drafts.setdefault(response_id, _Draft(channel_id, in_reply_to))
        async with draft.lock:
            if self._drafts.get(response_id) is not draft:
                return  # finished while this chunk waited for the lock
            if sequence != draft.next_sequence:
                draft.broken = True
            draft.next_sequence = sequence + 1
            draft.text += delta
            if final and outcome not in ("", "completed"):
                await self._abandon(response_id, draft, outcome)
                return
            if draft.broken:
                return
            if not draft.handle:
                if draft.text.strip():
                    await self._send_draft(response_id, draft)
                return
            self._schedule_edit(draft, now=final)

    async def reply(self, response_id: str, channel_id: str, in_reply_to: str, text: str) -> None:
        """The durable reply: its text becomes the message's final text (sent if nothing streamed).

        Returns once the ledger records it, so the caller acknowledges it afterwards."""
        draft = self._drafts.setdefault(response_id, _Draft(channel_id, in_reply_to))
        async with draft.lock:
            entry = self.ledger.get(response_id)
            if entry is not None and entry.final:
                self.counts.duplicates += 1
                log.info("reply already delivered", response_id=response_id)
                self._drafts.pop(response_id, None)
                return
            if draft.flush is not None:
                draft.flush.cancel()
            handle = draft.handle or (entry.handle if entry is not None else "")
            shown = draft.shown if draft.handle else ""
            final = fit(text, self.platform.limit)
            if not final.strip():
                if handle:
                    await self._delete(channel_id, handle)
            elif handle:
                if final != shown:
                    try:
                        await self.platform.edit(channel_id, handle, final)
                        self.counts.edited += 1
                    except PlatformError as exc:
                        if not exc.gone:
                            raise  # a rate limit or an outage: the reply comes again and edits then
                        # The streamed message was deleted by someone: the answer still arrives.
                        log.warning(
                            "final edit failed; sending anew", response_id=response_id, reason=str(exc)
                        )
                        handle = await self._send(channel_id, in_reply_to, final)
            else:
                handle = await self._send(channel_id, in_reply_to, final)
            self.ledger.put(response_id, Entry(channel_id, handle, True))
            self._drafts.pop(response_id, None)

    async def _send(self, channel_id: str, in_reply_to: str, text: str) -> str:
        handle = await self.platform.send(channel_id, in_reply_to, text)
        self.counts.sent += 1
        return handle

    async def _send_draft(self, response_id: str, draft: _Draft) -> None:
        text = fit(draft.text, self.platform.limit)
        try:
            draft.handle = await self._send(draft.channel_id, draft.in_reply_to, text)
        except PlatformError as exc:
            log.warning("streamed message not sent", response_id=response_id, reason=str(exc))
            draft.broken = True
            return
        draft.shown, draft.last_edit = text, time.monotonic()
        self.ledger.put(response_id, Entry(draft.channel_id, draft.handle, False))

    def _schedule_edit(self, draft: _Draft, *, now: bool) -> None:
        """Edit at most once per interval; the last text before a pause is always shown."""
        if draft.flush is not None and not draft.flush.done():
            return
        wait = 0.0 if now else max(0.0, draft.last_edit + self.edit_interval - time.monotonic())
        draft.flush = asyncio.get_running_loop().create_task(self._edit_later(draft, wait))

    async def _edit_later(self, draft: _Draft, wait: float) -> None:
        if wait:
            await asyncio.sleep(wait)
        async with draft.lock:
            text = fit(draft.text, self.platform.limit)
            if draft.broken or not draft.handle or text == draft.shown:
                return
            try:
                await self.platform.edit(draft.channel_id, draft.handle, text)
            except PlatformError as exc:
                log.warning("streamed edit failed", reason=str(exc))
                draft.broken = True
                return
            self.counts.edited += 1
            draft.shown, draft.last_edit = text, time.monotonic()

    async def _abandon(self, response_id: str, draft: _Draft, outcome: str) -> None:
        """A superseded or cancelled turn publishes no reply: remove what it streamed."""
        if draft.flush is not None:
            draft.flush.cancel()
        if draft.handle:
            await self._delete(draft.channel_id, draft.handle)
        self._drafts.pop(response_id, None)
        log.info("streamed reply abandoned", response_id=response_id, outcome=outcome)

    async def _delete(self, channel_id: str, handle: str) -> None:
        try:
            await self.platform.delete(channel_id, handle)
            self.counts.deleted += 1
        except PlatformError as exc:
            log.warning("streamed message not deleted", reason=str(exc))

    async def close(self) -> None:
        for draft in self._drafts.values():
            if draft.flush is not None:
                draft.flush.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await draft.flush
        self.ledger.close()
