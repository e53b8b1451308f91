"""GBNF grammars that hold a local model to the ``<response>`` contract, and the repair of a cut answer.

With a grammar, llama.cpp only samples tokens that keep the output a prefix of
the grammar's language, so even a 135M-parameter model answers in the contract.
Which elements the block has comes from the prompt itself: its output-format
example (``<response><thought>…</thought><actions>…</actions>…</response>``,
or ``<name>/<reasoning>/<action>`` for a should-respond question), so every
prompt gets the block it asks for. The bodies are bounded so that a complete
answer fits the token budget; if the budget still runs out (a character may take
several tokens), ``close_response`` completes the prefix it got, so the output
always parses.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

# Element text: no markup and no entities, so the block parses the same everywhere.
_CHAR = r"[^<>&]"
DEFAULT_ELEMENTS = ("thought", "actions", "text")
# Elements that hold action or provider names: upper-case names, comma separated.
_NAME_LISTS = {"actions": 1, "action": 1, "providers": 0, "evaluators": 0}
# The private thought is for the model alone: bounded short, so the user's text comes sooner.
THOUGHT_LIMIT = 96
_TAG = re.compile(r"<(/?)([A-Za-z_][A-Za-z0-9_]*)\s*(/?)>")
_BLOCK = re.compile(r"<response>(.*?)</response>", re.DOTALL)
MAX_ELEMENTS = 12


def _children(block: str) -> list[str]:
    """The direct children of an example block, in order, each once."""
    names: list[str] = []
    depth = 0
    for match in _TAG.finditer(block):
        closing, name, empty = match.group(1), match.group(2), match.group(3)
        if empty:
            if depth == 0 and name not in names:
                names.append(name)
            continue
        if closing:
            depth = max(0, depth - 1)
            continue
        if depth == 0 and name not in names:
            names.append(name)
        depth += 1
    return names[:MAX_ELEMENTS]


def contract_elements(stable: str, prompt: str) -> tuple[str, ...]:
    """The elements the prompt's own format example asks for.

    The first example in the stable segments (where the output format lives) wins; without
    stable segments the last example in the prompt does, since formats come after the
    conversation and a user's message must not choose the format.
    """
    for text, pick in ((stable, 0), (prompt, -1)):
        blocks = [b for b in _BLOCK.findall(text) if _children(b)]
        if blocks:
            return tuple(_children(blocks[pick]))
    return DEFAULT_ELEMENTS


def response_grammar(max_tokens: int, elements: Sequence[str] = DEFAULT_ELEMENTS) -> str:
    """``<response>`` with the given elements in order, their free text bounded by the token budget."""
    free = [e for e in elements if e not in _NAME_LISTS]
    room = max(24, max_tokens - 12 * len(elements) - 8)
    # ``text`` (what the user reads) gets twice the share of any other free element.
    shares = sum(2 if e == "text" else 1 for e in free) or 1
    rules = ['root ::= "<response>" ' + " ".join(f"e{i}" for i in range(len(elements))) + ' "</response>"']
    for index, name in enumerate(elements):
        if name in _NAME_LISTS:
            body = "names1" if _NAME_LISTS[name] else "names0"
        else:
            limit = max(8, min(1200, room * (2 if name == "text" else 1) // shares))
            if name == "thought":
                limit = min(limit, THOUGHT_LIMIT)
            body = f"t{index}"
            rules.append(f"t{index} ::= {_CHAR}{{0,{limit}}}")
        rules.append(f'e{index} ::= "<{name}>" {body} "</{name}>"')
    rules += [
        'names1 ::= name ("," name){0,3}',
        "names0 ::= names1?",
        "name ::= [A-Z] [A-Z_]{0,31}",
    ]
    return "\n".join(rules)


def fields_grammar(keys: Sequence[str], max_tokens: int) -> str:
    """One element per namespaced field, in order, inside ``<response>``."""
    room = max(16, max_tokens - 12 * len(keys) - 8)
    per_field = max(4, min(400, room // max(1, len(keys))))
    rules = ['root ::= "<response>" ' + " ".join(f"f{i}" for i in range(len(keys))) + ' "</response>"']
    for index, key in enumerate(keys):
        rules.append(f'f{index} ::= "<{key}>" value "</{key}>"')
    rules.append(f"value ::= {_CHAR}{{1,{per_field}}}")
    return "\n".join(rules)


def close_response(text: str, elements: Sequence[str] = DEFAULT_ELEMENTS) -> str:
    """Complete a prefix of ``response_grammar(…, elements)``'s language into a whole, parseable block."""
    if text.endswith("</response>"):
        return text
    cut = text.rfind("<")
    if cut >= 0 and ">" not in text[cut:]:
        text = text[:cut]  # a tag the budget cut in half
    parts = ["<response>"]
    for name in elements:
        parts += [f"<{name}>", f"</{name}>"]
    parts.append("</response>")
    position = 0
    reached = -1
    for index, tag in enumerate(parts):
        found = text.find(tag, position)
        if found < 0:
            break
        position = found + len(tag)
        reached = index
    if reached < 0:
        text, reached = "<response>", 0
    last = parts[reached]
    if last.startswith("<") and not last.startswith("</") and last != "<response>":
        name = last[1:-1]
        if name in _NAME_LISTS:
            text = text.rstrip(",")
            if text.endswith(last) and _NAME_LISTS[name]:
                text += "REPLY" if name == "actions" else "NONE"
    rest = []
    for tag in parts[reached + 1 :]:
        rest.append(tag)
        name = tag[1:-1]
        if not tag.startswith("</") and _NAME_LISTS.get(name):
            rest.append("REPLY" if name == "actions" else "NONE")
    return text + "".join(rest)
