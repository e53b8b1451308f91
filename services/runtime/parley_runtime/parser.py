"""Parse the ``<response>`` block a model writes, after the elizaOS core runtime.

Model output is routinely malformed XML, so this is a hand-written scanner rather than an XML library:
unmatched tags are skipped instead of failing the turn. Every search is bounded or cached so that any
input, however hostile, is scanned in linear time, and every limit fails the whole parse (``None``)
rather than yielding a partial result.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from itertools import islice
from typing import Final

__all__ = [
    "MAX_BODY_BYTES",
    "MAX_DEPTH",
    "MAX_ELEMENTS",
    "MAX_INPUT_BYTES",
    "ParsedResponse",
    "normalize_actions",
    "parse_or_plain",
    "parse_response",
]

MAX_INPUT_BYTES: Final = 1_048_576
MAX_BODY_BYTES: Final = 262_144
MAX_ELEMENTS: Final = 64
"""Start tags (self-closing and unmatched ones included) allowed inside the block, at any depth."""
MAX_DEPTH: Final = 32
"""Nesting allowed inside the block; the block's direct children are at depth 1."""

_TRUE: Final = frozenset({"true", "yes", "1"})

_START: Final = 0
_EMPTY: Final = 1
_END: Final = 2
_CDATA: Final = 3
_SKIP: Final = 4


_Token = tuple[int, int, int, str]
"""(kind, start offset, end offset, tag name); the offsets span the whole tag in the source."""

_Span = tuple[int, int]
"""Token indices of a matched start tag and its end tag."""


@dataclass(frozen=True, slots=True)
class ParsedResponse:
    thought: str = ""
    actions: list[str] = field(default_factory=list)
    action_params: dict[str, dict[str, object]] = field(default_factory=dict)
    providers: list[str] = field(default_factory=list)
    evaluators: list[str] = field(default_factory=list)
    text: str = ""
    simple: bool = False
    fields: dict[str, str] = field(default_factory=dict)


def parse_response(text: str) -> ParsedResponse | None:
    """The model's response, or ``None`` if there is none to trust: a broken limit is never partial."""
    if not text or _utf8_exceeds(text, MAX_INPUT_BYTES):
        return None
    located = _locate(text)
    if located is None:
        return None
    toks, open_idx, close_idx = located
    if _utf8_exceeds(text[toks[open_idx][2] : toks[close_idx][1]], MAX_BODY_BYTES):
        return None
    return _read_block(text, toks, open_idx, close_idx)


def parse_or_plain(text: str) -> ParsedResponse:
    """Like :func:`parse_response`, but a model that ignored the format and just talked is a reply."""
    parsed = parse_response(text)
    if parsed is not None:
        return parsed
    stripped = text.strip()
    if not stripped or _looks_like_xml(stripped):
        return ParsedResponse()
    return ParsedResponse(actions=["REPLY"], text=_cap_utf8(stripped, MAX_BODY_BYTES))


def normalize_actions(parsed: ParsedResponse) -> list[str]:
    """Resolve contradictory action lists the way elizaOS does.

    IGNORE next to real actions is a model hedging: the text decides whether it meant to answer.
    """
    names = [name.strip().upper() for name in parsed.actions if name.strip()]
    if not names:
        return ["IGNORE"]
    if "IGNORE" in names:
        others = [name for name in names if name != "IGNORE"]
        if not others or not parsed.text.strip():
            return ["IGNORE"]
        names = others
    if "STOP" in names:
        others = [name for name in names if name != "STOP"]
        names = others or ["STOP"]
    return names


def _utf8_exceeds(text: str, limit: int) -> bool:
    if len(text) > limit:
        return True
    if len(text) * 4 <= limit:
        return False
    return len(text.encode("utf-8", "surrogatepass")) > limit


def _cap_utf8(text: str, limit: int) -> str:
    if not _utf8_exceeds(text, limit):
        return text
    raw = text.encode("utf-8", "surrogatepass")
    cut = limit
    while cut > 0 and raw[cut] & 0xC0 == 0x80:
        cut -= 1
    return raw[:cut].decode("utf-8", "surrogatepass").rstrip()


def _looks_like_xml(text: str) -> bool:
    i = text.find("<")
    while 0 <= i < len(text) - 1:
        if text[i + 1].isalpha():
            return True
        i = text.find("<", i + 1)
    return False


def _unescape(text: str) -> str:
    """Decode the five XML entities in one pass: ``&amp;`` goes last, so ``&amp;lt;`` yields ``&lt;``."""
    if "&" not in text:
        return text
    return (
        text.replace("&lt;", "<")
        .replace("&gt;", ">")
        .replace("&quot;", '"')
        .replace("&apos;", "'")
        .replace("&amp;", "&")
    )


class _Finder:
    """``str.find`` that remembers its last answer per needle.

    Unterminated comments, CDATA sections and processing instructions would otherwise each rescan
    to the end of the input, which is quadratic on input such as ``"<!--" * n``.
    """

    __slots__ = ("_memo", "_src")

    def __init__(self, src: str) -> None:
        self._src = src
        self._memo: dict[str, tuple[int, int]] = {}

    def find(self, needle: str, start: int) -> int:
        memo = self._memo.get(needle)
        if memo is not None:
            origin, found = memo
            if origin <= start and (found < 0 or found >= start):
                return found
        found = self._src.find(needle, start)
        self._memo[needle] = (start, found)
        return found


def _name_end(src: str, k: int) -> int:
    n = len(src)
    while k < n:
        c = src[k]
        if not (c.isalnum() or c in "_-.:"):
            break
        k += 1
    return k


def _is_plain_name(name: str) -> bool:
    """A fast, stricter subset of the name rule in :func:`_name_end`, for the common tag shapes."""
    return name.replace("_", "").isalnum()


def _tokens(src: str) -> Iterator[_Token]:
    """Every piece of markup in order; a ``<`` that starts none is ordinary text.

    The source is split at ``<`` up front, so plain text costs no Python-level work. Only comments,
    CDATA sections and processing instructions may contain ``<``; every other construct lies within
    its own part, which keeps the scan linear.
    """
    finder = _Finder(src)
    parts = src.split("<")
    seg = len(parts[0])
    resume = 0
    for part in islice(parts, 1, None):
        i = seg
        seg = i + 1 + len(part)
        if i < resume or not part:
            continue
        c = part[0]
        tok: _Token | None = None
        if c.isalpha() or c == "_":
            gt = part.find(">")
            if gt > 0:
                name = part[:gt]
                if name.isalnum() or _is_plain_name(name):
                    yield (_START, i, i + gt + 2, name)
                    continue
                if name[-1] == "/" and _is_plain_name(name[:-1]):
                    yield (_EMPTY, i, i + gt + 2, name[:-1])
                    continue
                tok = _start_tag(src, i, seg)
        elif c == "/":
            gt = part.find(">")
            if gt > 1:
                name = part[1:gt]
                if (name.isalnum() or _is_plain_name(name)) and (name[0].isalpha() or name[0] == "_"):
                    yield (_END, i, i + gt + 2, name)
                    continue
                tok = _end_tag(src, i, seg)
        elif c == "!":
            tok = _declaration(src, i, seg, finder)
        elif c == "?":
            close = finder.find("?>", i + 2)
            if close >= 0:
                tok = (_SKIP, i, close + 2, "")
        if tok is not None:
            resume = tok[2]
            yield tok


def _start_tag(src: str, i: int, seg: int) -> _Token | None:
    k = _name_end(src, i + 1)
    if k >= seg:
        return None
    name = src[i + 1 : k]
    c = src[k]
    if c == ">":
        return (_START, i, k + 1, name)
    if c == "/":
        return (_EMPTY, i, k + 2, name) if src.startswith(">", k + 1) else None
    if not c.isspace():
        return None
    gt = _attributes_end(src, k, seg)
    if gt < 0:
        return None
    return (_EMPTY if src[gt - 1] == "/" else _START, i, gt + 1, name)


def _attributes_end(src: str, k: int, seg: int) -> int:
    """The ``>`` closing a start tag whose attributes begin at ``k``, or -1.

    Quoted values may hold ``>``; each of the three cursors only moves forward, so a tag with many
    attributes is still scanned in linear time.
    """
    gt = src.find(">", k, seg)
    dq = src.find('"', k, seg)
    sq = src.find("'", k, seg)
    while gt >= 0:
        q = dq if dq >= 0 and (sq < 0 or dq < sq) else sq
        if q < 0 or q > gt:
            return gt
        close = src.find(src[q], q + 1, seg)
        if close < 0:
            return -1
        k = close + 1
        if gt < k:
            gt = src.find(">", k, seg)
        if 0 <= dq < k:
            dq = src.find('"', k, seg)
        if 0 <= sq < k:
            sq = src.find("'", k, seg)
    return -1


def _end_tag(src: str, i: int, seg: int) -> _Token | None:
    if i + 2 >= seg or not (src[i + 2].isalpha() or src[i + 2] == "_"):
        return None
    k = _name_end(src, i + 2)
    name = src[i + 2 : k]
    while k < seg and src[k].isspace():
        k += 1
    if k < seg and src[k] == ">":
        return (_END, i, k + 1, name)
    return None


def _declaration(src: str, i: int, seg: int, finder: _Finder) -> _Token | None:
    if src.startswith("<!--", i):
        close = finder.find("-->", i + 4)
        return None if close < 0 else (_SKIP, i, close + 3, "")
    if src.startswith("<![CDATA[", i):
        close = finder.find("]]>", i + 9)
        return None if close < 0 else (_CDATA, i, close + 3, "")
    gt = src.find(">", i + 2, seg)
    return None if gt < 0 else (_SKIP, i, gt + 1, "")


def _locate(src: str) -> tuple[list[_Token], int, int] | None:
    """Tokenize up to the block to read: the first closed ``<response>``, else the first closed element.

    Start tags are matched to end tags of the same name only, so a stray or crossing tag of another
    name cannot hide the block.
    """
    toks: list[_Token] = []
    stacks: dict[str, list[int]] = {}
    best_response: _Span | None = None
    best_any: _Span | None = None
    append = toks.append
    for idx, tok in enumerate(_tokens(src)):
        append(tok)
        kind, _, _, name = tok
        if kind == _START:
            stack = stacks.get(name)
            if stack is None:
                stacks[name] = [idx]
            else:
                stack.append(idx)
        elif kind == _END:
            stack = stacks.get(name)
            if not stack:
                continue
            start = stack.pop()
            if name == "response":
                if not stack:
                    return toks, start, idx
                if best_response is None or start < best_response[0]:
                    best_response = (start, idx)
            elif best_any is None or start < best_any[0]:
                best_any = (start, idx)
    best = best_response or best_any
    return None if best is None else (toks, best[0], best[1])


def _match(toks: list[_Token], lo: int, hi: int) -> dict[int, int]:
    stacks: dict[str, list[int]] = {}
    matched: dict[int, int] = {}
    for k in range(lo, hi):
        kind, _, _, name = toks[k]
        if kind == _START:
            stacks.setdefault(name, []).append(k)
        elif kind == _END:
            stack = stacks.get(name)
            if stack:
                matched[stack.pop()] = k
    return matched


def _children(toks: list[_Token], lo: int, hi: int, matched: dict[int, int] | None = None) -> list[_Span]:
    if matched is None:
        matched = _match(toks, lo, hi)
    spans: list[_Span] = []
    k = lo
    while k < hi:
        end = matched.get(k)
        if end is None:
            k += 1
        else:
            spans.append((k, end))
            k = end + 1
    return spans


def _within_limits(toks: list[_Token], lo: int, hi: int, matched: dict[int, int]) -> bool:
    elements = 0
    for k in range(lo, hi):
        if toks[k][0] in (_START, _EMPTY):
            elements += 1
            if elements > MAX_ELEMENTS:
                return False
    ends = set(matched.values())
    depth = 0
    for k in range(lo, hi):
        if k in matched:
            depth += 1
            if depth > MAX_DEPTH:
                return False
        elif k in ends:
            depth -= 1
    return True


def _value(src: str, toks: list[_Token], span: _Span) -> str:
    """The element's content: text unescaped, CDATA literal, comments dropped, nested markup verbatim."""
    start, end = span
    pos = toks[start][2]
    parts: list[str] = []
    for k in range(start + 1, end):
        kind, tok_start, tok_end, _ = toks[k]
        if tok_start > pos:
            parts.append(_unescape(src[pos:tok_start]))
        if kind == _CDATA:
            parts.append(src[tok_start + 9 : tok_end - 3])
        elif kind != _SKIP:
            parts.append(src[tok_start:tok_end])
        pos = tok_end
    parts.append(_unescape(src[pos : toks[end][1]]))
    return "".join(parts).strip()


def _split_list(value: str) -> list[str]:
    return [item for item in (part.strip() for part in value.split(",")) if item]


def _json_object(text: str) -> dict[str, object] | None:
    if not text.startswith("{"):
        return None
    try:
        loaded = json.loads(text)
    except (ValueError, RecursionError):
        return None
    return loaded if isinstance(loaded, dict) else None


def _attribute(src: str, tok: _Token, wanted: str) -> str:
    attrs = src[tok[1] + 1 + len(tok[3]) : tok[2] - 1]
    n = len(attrs)
    k = 0
    while k < n:
        while k < n and (attrs[k].isspace() or attrs[k] == "/"):
            k += 1
        key_start = k
        while k < n and not attrs[k].isspace() and attrs[k] not in "=/":
            k += 1
        key = attrs[key_start:k]
        while k < n and attrs[k].isspace():
            k += 1
        value = ""
        if k < n and attrs[k] == "=":
            k += 1
            while k < n and attrs[k].isspace():
                k += 1
            if k < n and attrs[k] in "\"'":
                close = attrs.find(attrs[k], k + 1)
                close = n if close < 0 else close
                value = attrs[k + 1 : close]
                k = close + 1
            else:
                value_start = k
                while k < n and not attrs[k].isspace():
                    k += 1
                value = attrs[value_start:k]
        if key == wanted:
            return _unescape(value).strip()
    return ""


def _params(src: str, toks: list[_Token], span: _Span) -> dict[str, object]:
    """Child elements as strings, or a JSON object written as the content.

    JSON is tried first: content that parses as an object is JSON even if a string in it holds markup.
    """
    loaded = _json_object(_value(src, toks, span))
    if loaded is not None:
        return loaded
    return {toks[kid[0]][3]: _value(src, toks, kid) for kid in _children(toks, span[0] + 1, span[1])}


def _planner_params(src: str, toks: list[_Token], span: _Span) -> dict[str, dict[str, object]]:
    loaded = _json_object(_value(src, toks, span))
    if loaded is not None:
        return {name: dict(params) for name, params in loaded.items() if isinstance(params, dict)}
    return {toks[kid[0]][3]: _params(src, toks, kid) for kid in _children(toks, span[0] + 1, span[1])}


def _nested_actions(src: str, toks: list[_Token], spans: list[_Span]) -> list[tuple[str, dict[str, object]]]:
    actions: list[tuple[str, dict[str, object]]] = []
    for span in spans:
        kids = _children(toks, span[0] + 1, span[1])
        name = ""
        params: dict[str, object] = {}
        for kid in kids:
            tag = toks[kid[0]][3]
            if tag == "name":
                name = _value(src, toks, kid)
            elif tag == "params":
                params = _params(src, toks, kid)
        if not name:
            name = _attribute(src, toks[span[0]], "name")
        if not name and not kids:
            name = _value(src, toks, span)
        if name:
            actions.append((name, params))
    return actions


def _read_block(src: str, toks: list[_Token], open_idx: int, close_idx: int) -> ParsedResponse | None:
    lo, hi = open_idx + 1, close_idx
    matched = _match(toks, lo, hi)
    if not _within_limits(toks, lo, hi, matched):
        return None
    values: dict[str, str] = {}
    last: dict[str, _Span] = {}
    for span in _children(toks, lo, hi, matched):
        name = toks[span[0]][3]
        values[name] = _value(src, toks, span)
        last[name] = span
    if not values:
        return None

    action_params: dict[str, dict[str, object]] = {}
    if "params" in last:
        action_params = _planner_params(src, toks, last["params"])
    actions = _split_list(values.get("actions", ""))
    if "actions" in last:
        span = last["actions"]
        nested = [kid for kid in _children(toks, span[0] + 1, span[1]) if toks[kid[0]][3] == "action"]
        if nested:
            actions = []
            for name, params in _nested_actions(src, toks, nested):
                actions.append(name)
                if params:
                    action_params[name] = {**action_params.get(name, {}), **params}

    return ParsedResponse(
        thought=values.get("thought", ""),
        actions=actions,
        action_params=action_params,
        providers=_split_list(values.get("providers", "")),
        evaluators=_split_list(values.get("evaluators", "")),
        text=values.get("text", ""),
        simple=values.get("simple", "").lower() in _TRUE,
        fields=values,
    )
