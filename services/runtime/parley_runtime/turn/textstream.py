"""The reply's text as the model writes it: the ``<response>`` contract parsed incrementally.

Only the content of the block's ``<text>`` element is released, decoded as the full parser
(``parser.parse_or_plain``) decodes it: the five XML entities, CDATA literally, comments and
processing instructions dropped, other markup inside the text verbatim, leading and trailing
whitespace stripped. Nothing else is ever released: no ``<thought>``, no tags, no action names.

What is released is always a prefix of what the full parser will find, whatever the split of the
output into pieces; for that the scanner waits, rather than guesses:

- on an incomplete construct (a tag, an entity, a comment or CDATA section not yet closed);
- on trailing whitespace (it may be the end of the text, which the parser strips);
- on the last ``longest secret - 1`` characters when the agent has secrets, and on any secret
  that straddles that point, so the released text is the redacted text's prefix;
- on the whole text unless ``<actions>`` came first, closed, and starts with ``REPLY``, and
  ``<providers>`` (if it came first) names none: otherwise the text may never be said, or the
  model will be asked again.

A model that writes a second ``<text>``, or an action that changes the text, can still make the
reply differ from what was released: ``finish`` says so, and the stream ends ``revised``.
"""

from __future__ import annotations

from ..parser import ParsedResponse, normalize_actions
from ..secrets import REDACTED, Redactor

_ENTITIES = {"&lt;": "<", "&gt;": ">", "&quot;": '"', "&apos;": "'", "&amp;": "&"}
_LONGEST_ENTITY = max(len(e) for e in _ENTITIES)
_OPEN = "<response>"
_SEEK, _BLOCK, _TEXT, _DONE = range(4)


class TextStream:
    def __init__(self, redactor: Redactor | None = None) -> None:
        self.redactor = redactor if redactor else None
        self.buf = ""
        self.pos = 0
        self.state = _SEEK
        self.actions: list[str] | None = None
        self.providers_named = False
        self.allowed = False  # the text may be released as it comes
        self.closed = False  # ``</text>`` seen
        self.parts: list[str] = []
        self.released = ""

    def feed(self, piece: str) -> str:
        """Take the next piece of the model's output; returns the text newly released."""
        self.buf += piece
        self._scan()
        return self._release()

    def finish(self, final_text: str) -> str | None:
        """The rest of the reply whose text is ``final_text`` (as stored and published), or None
        when what was released is not its beginning."""
        if not final_text.startswith(self.released):
            return None
        rest = final_text[len(self.released) :]
        self.released = final_text
        return rest

    # -- scanning ------------------------------------------------------------------------------

    def _scan(self) -> None:
        progressed = True
        while progressed and self.state != _DONE:
            before = (self.state, self.pos)
            if self.state == _SEEK:
                self._seek()
            elif self.state == _BLOCK:
                self._block()
            else:
                self._text()
            progressed = (self.state, self.pos) != before

    def _seek(self) -> None:
        found = self.buf.find(_OPEN, self.pos)
        if found < 0:
            self.pos = max(self.pos, len(self.buf) - len(_OPEN) + 1)
        else:
            self.pos, self.state = found + len(_OPEN), _BLOCK

    def _block(self) -> None:
        buf = self.buf
        lt = buf.find("<", self.pos)
        if lt < 0:
            self.pos = len(buf)
            return
        skipped = self._skip_special(lt)
        if skipped is not None:
            if skipped >= 0:
                self.pos = skipped
            else:
                self.pos = lt  # wait for its end
            return
        gt = buf.find(">", lt)
        if gt < 0:
            self.pos = lt
            return
        tag = buf[lt + 1 : gt]
        if tag.startswith("/"):
            self.pos = gt + 1
            if tag[1:].strip() == "response":
                self.state = _DONE
            return
        name = tag.split(None, 1)[0] if tag.strip() else ""
        if not name or tag.endswith("/") or not (name[0].isalpha() or name[0] == "_"):
            self.pos = gt + 1
            return
        if name == "text":
            self.allowed = (
                self.actions is not None and self.actions[:1] == ["REPLY"] and not self.providers_named
            )
            self.pos, self.state = gt + 1, _TEXT
            return
        close = buf.find(f"</{name}>", gt + 1)
        if close < 0:
            self.pos = lt
            return
        content = buf[gt + 1 : close]
        if name == "actions":
            self.actions = normalize_actions(ParsedResponse(actions=content.split(","), text="x"))
            if "<" in content:  # nested <action> elements: decided by the full parser only
                self.actions = ["NESTED"]
        elif name == "providers":
            self.providers_named = bool(content.strip())
        self.pos = close + len(name) + 3

    def _skip_special(self, lt: int) -> int | None:
        """Comments, processing instructions and declarations: None if ``lt`` starts none, -1 if
        one starts but is not complete yet, else the position after it."""
        buf = self.buf
        for opener, closer in (("<!--", "-->"), ("<?", "?>"), ("<!", ">")):
            if buf.startswith(opener, lt):
                if opener == "<!" and buf.startswith("<![CDATA[", lt):
                    return None
                end = buf.find(closer, lt + len(opener))
                return -1 if end < 0 else end + len(closer)
            if opener.startswith(buf[lt : lt + len(opener)]) and len(buf) - lt < len(opener):
                return -1  # could still become one
        return None

    def _text(self) -> None:
        buf, pos, parts = self.buf, self.pos, self.parts
        while pos < len(buf):
            lt, amp = buf.find("<", pos), buf.find("&", pos)
            nxt = min(x for x in (lt, amp, len(buf)) if x >= 0)
            if nxt > pos:
                parts.append(buf[pos:nxt])
                pos = nxt
                continue
            if buf[pos] == "&":
                end = buf.find(";", pos, pos + _LONGEST_ENTITY)
                if end < 0 and len(buf) - pos < _LONGEST_ENTITY:
                    break  # the entity may not be complete yet
                entity = buf[pos : end + 1] if end >= 0 else ""
                parts.append(_ENTITIES.get(entity, "&"))
                pos += len(entity) if entity in _ENTITIES else 1
                continue
            taken = self._markup(pos)
            if taken < 0:
                break
            if self.state == _BLOCK:
                self.pos = taken
                return
            pos = taken
        self.pos = pos

    def _markup(self, lt: int) -> int:
        """Markup inside the text at ``lt``: the position after it, or -1 to wait for more."""
        buf, parts = self.buf, self.parts
        if buf.startswith("<![CDATA[", lt):
            end = buf.find("]]>", lt + 9)
            if end < 0:
                return -1
            parts.append(buf[lt + 9 : end])
            return end + 3
        if len(buf) - lt < 9 and "<![CDATA[".startswith(buf[lt:]):
            return -1
        skipped = self._skip_special(lt)
        if skipped is not None:
            return skipped
        gt = buf.find(">", lt)
        nxt = buf.find("<", lt + 1)
        if gt < 0 and nxt < 0:
            return -1  # a tag, or a lone "<", decided by what follows
        if gt < 0 or 0 <= nxt < gt or not _tag_like(buf[lt + 1 : gt]):
            parts.append("<")  # a "<" that starts no tag is text
            return lt + 1
        if buf[lt + 1 : gt].rstrip() == "/text":
            self.closed, self.state = True, _BLOCK
            return gt + 1
        if buf[lt + 1 : gt].split(None, 1)[0] == "text":
            self.allowed = False  # a nested <text>: left to the full parser
        parts.append(buf[lt : gt + 1])  # other markup stays in the text verbatim
        return gt + 1

    # -- releasing -----------------------------------------------------------------------------

    def _release(self) -> str:
        if not self.allowed:
            return ""
        text = "".join(self.parts).lstrip()
        self.parts = [text] if text else []
        safe = text.rstrip()
        redacted = self._redacted_prefix(safe)
        if len(redacted) <= len(self.released) or not redacted.startswith(self.released):
            return ""
        delta = redacted[len(self.released) :]
        self.released = redacted
        return delta

    def _redacted_prefix(self, safe: str) -> str:
        redactor = self.redactor
        if redactor is None:
            return safe
        spans = redactor.spans(safe)
        cut = len(safe) if self.closed else max(0, len(safe) - redactor.longest + 1)
        out: list[str] = []
        at = 0
        for start, end in spans:
            if start >= cut:
                break
            if end > cut:
                cut = start
                break
            out += (safe[at:start], REDACTED)
            at = end
        out.append(safe[at:cut])
        return "".join(out)


def _tag_like(inner: str) -> bool:
    if inner.startswith("/"):
        inner = inner[1:]
    return bool(inner) and (inner[0].isalpha() or inner[0] == "_")
