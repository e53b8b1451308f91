"""Custom action definitions: the validated document, placeholders and their rendering.

A definition is ``{id, name, description, similes, parameters, handler, enabled, createdAt,
updatedAt}``. Handler strings refer to parameters as ``{{name}}``; every placeholder must name a
declared parameter, so a typo is an error when the definition is added, not a silent blank at run
time. Validation errors name the field and never repeat the value: header values and URLs may hold
credentials.
"""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Callable, Mapping
from datetime import datetime
from typing import Annotated, Any, Literal

import yaml
from jsonschema import Draft202012Validator
from jsonschema.exceptions import SchemaError
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from .. import errors
from ..names import ACTION_NAME

__all__ = [
    "CodeHandler",
    "CustomActionDef",
    "HttpHandler",
    "ParameterDef",
    "ShellHandler",
    "describe_errors",
    "parse_definition",
    "parse_definitions",
    "placeholders",
    "render",
]

# ``{{name}}`` is a parameter; ``{{secret:NAME}}`` (http handlers only) is the agent's setting NAME,
# read at run time (get_setting: the character's encrypted secrets first), so a definition need not
# carry a credential itself.
SECRET_PREFIX = "secret:"
PLACEHOLDER = re.compile(r"\{\{((?:secret:)?[A-Za-z_][A-Za-z0-9_]*)\}\}")
# ``{{ name }}`` (whitespace inside the braces) is refused in every handler: shlex would split it
# into three words, so it could not mean the same thing everywhere.
SPACED_PLACEHOLDER = re.compile(r"\{\{\s*(?:secret:)?[A-Za-z_][A-Za-z0-9_]*\s*\}\}")
SPACED_MESSAGE = "write placeholders without spaces inside the braces, as {{name}}"
HEADER_NAME = re.compile(r"^[!#$%&'*+.^_`|~0-9A-Za-z-]{1,128}$")
SENSITIVE_HEADER = re.compile(r"auth|cookie|token|key|secret|passw|session|signature", re.IGNORECASE)
# Well below the inbound ack wait (60 s by default): a turn that runs an action must still finish.
MAX_TIMEOUT_SECONDS = 30.0


def placeholders(template: str) -> list[str]:
    return [m.group(1) for m in PLACEHOLDER.finditer(template)]


def param_text(value: object) -> str:
    """A parameter value as text: strings as they are, anything else as JSON, a missing one blank."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    return json.dumps(value, ensure_ascii=False, sort_keys=True)


def render(template: str, params: Mapping[str, object], encode: Callable[[str, int], str]) -> str:
    """One pass over ``template``: each placeholder becomes ``encode(value, offset)``.

    A single pass means a value containing ``{{other}}`` (or ``}}``) is never expanded again.
    """
    return PLACEHOLDER.sub(lambda m: encode(param_text(params.get(m.group(1))), m.start()), template)


def json_string_spans(template: str) -> list[tuple[int, int]]:
    """The ``[start, end)`` offsets of the JSON string literals of ``template`` (quotes included).

    A placeholder inside one is JSON-escaped; one outside becomes a whole JSON string. Either way a
    value cannot end the string it is in. An unterminated string runs to the end.
    """
    spans: list[tuple[int, int]] = []
    i, n = 0, len(template)
    while i < n:
        if template[i] != '"':
            i += 1
            continue
        start, i = i, i + 1
        while i < n and template[i] != '"':
            i += 2 if template[i] == "\\" else 1
        spans.append((start, min(i + 1, n)))
        i += 1
    return spans


def shell_quoted_offsets(template: str) -> list[int]:
    """Offsets of the placeholders of ``template`` that sit inside shell quotes."""
    inside: list[int] = []
    quote = ""
    i, n = 0, len(template)
    while i < n:
        ch = template[i]
        if not quote and ch == "\\":
            i += 2
            continue
        if quote == '"' and ch == "\\":
            i += 2
            continue
        if ch in "'\"" and (not quote or quote == ch):
            quote = "" if quote else ch
        elif quote and template.startswith("{{", i) and PLACEHOLDER.match(template, i):
            inside.append(i)
        i += 1
    return inside


WORD_BEFORE = frozenset(" \t\n|&;<>(=")
WORD_AFTER = frozenset(" \t\n|&;<>)")
SHELL_SYNTAX = frozenset("|&;<>()$`*?~!{}[]#\n")


def needs_shell(command: str) -> bool:
    """Whether the command uses shell syntax (operators, expansions, globs) outside single quotes;
    without it, it is split with shlex and run with exec."""
    text = PLACEHOLDER.sub("x", command)
    quote = ""
    i = 0
    while i < len(text):
        ch = text[i]
        if quote == "'":
            quote = "" if ch == "'" else quote
        elif ch == "\\":
            i += 1
        elif quote == '"':
            if ch == '"':
                quote = ""
            elif ch in "$`":
                return True
        elif ch in "'\"":
            quote = ch
        elif ch in SHELL_SYNTAX:
            return True
        i += 1
    return False


HEREDOC = re.compile(r"<<-?[ \t]*(['\"]?)([A-Za-z_][A-Za-z0-9_]*)\1")
RESERVED_WORDS = frozenset({"if", "then", "else", "elif", "while", "until", "do", "!", "{", "time", "exec"})
ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
REDIRECTION = re.compile(r"^[0-9]*[<>]")
REDIRECTION_END = re.compile(r"[0-9]*(?:<<-?|>>|>&|<&|>\||<>|[<>])$")


def heredoc_bodies(command: str) -> list[tuple[int, int, bool]]:
    """``[start, end)`` of each here-document body of ``command``, and whether its delimiter is
    quoted (no expansion inside). Approximate: the ``<<WORD`` operators are found line by line."""
    bodies: list[tuple[int, int, bool]] = []
    lines = command.splitlines(keepends=True)
    offset = 0
    pending: list[tuple[str, bool, bool]] = []  # delimiter, quoted, strip tabs
    start = -1
    for line in lines:
        if pending:
            delimiter, quoted, tabs = pending[0]
            if start < 0:
                start = offset
            text = line.rstrip("\n")
            if (text.lstrip("\t") if tabs else text) == delimiter:
                bodies.append((start, offset, quoted))
                pending.pop(0)
                start = -1
        else:
            for m in HEREDOC.finditer(PLACEHOLDER.sub("x", line)):
                pending.append((m.group(2), bool(m.group(1)), m.group(0).startswith("<<-")))
        offset += len(line)
    if pending and start >= 0:
        bodies.append((start, len(command), pending[0][1]))
    return bodies


def in_command_position(command: str, offset: int) -> bool:
    """Whether the word starting at ``offset`` is the program of a simple command: first in the
    command, after an operator (``|``, ``;``, ``&``, ``&&``, ``||``, ``(``, a newline), after a
    reserved word or after the assignments that precede a command."""
    text = PLACEHOLDER.sub(lambda m: "x" * len(m.group(0)), command[:offset])
    while True:
        text = text.rstrip(" \t")
        if not text or text[-1] in "|;&(\n`":
            return True
        if text.endswith("$("):
            return True
        word = re.split(r"[ \t|;&()\n`]", text)[-1]
        if word in RESERVED_WORDS:
            return True
        if ASSIGNMENT.match(word) or REDIRECTION.match(word):  # "X=1 cmd", ">out cmd"
            text = text[: -len(word)]
            continue
        rest = text[: -len(word)].rstrip(" \t")
        operator = REDIRECTION_END.search(rest)
        if operator is not None:  # "> out cmd", "2>&1 cmd": the word is a redirection's target
            text = rest[: operator.start()]
            continue
        return False


class ParameterDef(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    name: str = Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")
    description: str = Field(default="", max_length=1000)
    required: bool = False
    json_schema: dict[str, Any] = Field(default_factory=lambda: {"type": "string"}, alias="schema")

    @field_validator("json_schema")
    @classmethod
    def _valid_schema(cls, value: dict[str, Any]) -> dict[str, Any]:
        try:
            Draft202012Validator.check_schema(value)
        except SchemaError as exc:
            raise ValueError(f"not a valid JSON schema ({exc.message})") from None
        return value


def _timeout() -> Any:
    return Field(default=10.0, gt=0, le=MAX_TIMEOUT_SECONDS, alias="timeoutSeconds")


class HttpHandler(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    type: Literal["http"]
    method: Literal["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD"] = "GET"
    url: str = Field(min_length=1, max_length=4096)
    headers: dict[str, str] = Field(default_factory=dict, max_length=64)
    body_template: str | None = Field(default=None, alias="bodyTemplate", max_length=65536)

    @field_validator("method", mode="before")
    @classmethod
    def _upper(cls, value: Any) -> Any:
        return value.upper() if isinstance(value, str) else value

    @field_validator("url")
    @classmethod
    def _http_url(cls, value: str) -> str:
        if SPACED_PLACEHOLDER.search(PLACEHOLDER.sub("", value)):
            raise ValueError(SPACED_MESSAGE)
        scheme = value.split(":", 1)[0].lower() if ":" in value else ""
        if scheme not in ("http", "https") or not value[len(scheme) :].startswith("://"):
            raise ValueError("must be an http:// or https:// URL")
        if any(ord(c) < 0x21 or c == "\x7f" for c in value):
            raise ValueError("must not contain spaces or control characters")
        return value

    @field_validator("body_template")
    @classmethod
    def _json_body(cls, value: str | None) -> str | None:
        if value is None or SPACED_PLACEHOLDER.search(PLACEHOLDER.sub("", value)):
            return value  # a spaced placeholder is refused with the field's name by CustomActionDef
        if re.search(r"(?<!\\)(?:\\\\)*\\\{\{", value):
            # "\{{x}}": the backslash would escape the first character of the JSON-escaped value.
            raise ValueError("a {{placeholder}} must not follow a backslash")
        spans = json_string_spans(value)

        def empty(match: re.Match[str]) -> str:
            return "" if any(start < match.start() < end for start, end in spans) else '""'

        try:
            json.loads(PLACEHOLDER.sub(empty, value))
        except ValueError:
            raise ValueError(
                "must be a JSON document (with each {{placeholder}} as an empty string)"
            ) from None
        return value

    @field_validator("headers")
    @classmethod
    def _header_fields(cls, value: dict[str, str]) -> dict[str, str]:
        for name, text in value.items():
            if not HEADER_NAME.match(name):
                raise ValueError("a header name is not a valid HTTP token")
            if name.lower() in ("host", "content-length", "transfer-encoding", "connection"):
                raise ValueError(f"the {name} header is set by the runtime")
            if any((ord(c) < 0x20 and c != "\t") or c == "\x7f" for c in text):
                raise ValueError(f"the value of header {name} contains control characters")
            if not text.isascii():
                raise ValueError(f"the value of header {name} must be ASCII")
        return value


class ShellHandler(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    type: Literal["shell"]
    command: str = Field(min_length=1, max_length=8192)
    timeout_seconds: float = _timeout()

    @field_validator("command")
    @classmethod
    def _placeholders_safe(cls, value: str) -> str:
        if "\x00" in value:
            raise ValueError("must not contain NUL")
        if SPACED_PLACEHOLDER.search(PLACEHOLDER.sub("", value)):
            return value  # refused with the field's name by CustomActionDef
        if not needs_shell(value):
            try:
                words = shlex.split(value)
            except ValueError:
                raise ValueError("is not a valid command (unbalanced quotes)") from None
            if not words:
                raise ValueError("is empty")
            if PLACEHOLDER.search(words[0]):
                raise ValueError("a {{placeholder}} must not be the program to run")
            return value
        if shell_quoted_offsets(value):
            # A value would be "$N" there: a quoted reference inside quotes would be unquoted.
            raise ValueError("a command that needs a shell must not put {{placeholders}} inside quotes")
        bodies = heredoc_bodies(value)
        for match in PLACEHOLDER.finditer(value):
            if "((" in value[: match.start()]:
                raise ValueError("a {{placeholder}} must not be used in shell arithmetic, (( )) or $(( ))")
            body = next((quoted for start, end, quoted in bodies if start <= match.start() < end), None)
            if body is not None:
                if body:
                    raise ValueError("a {{placeholder}} inside a quoted here-document would not be expanded")
                line_start = value.rfind("\n", 0, match.start()) + 1
                line_end = value.find("\n", match.end())
                line = value[line_start : line_end if line_end >= 0 else len(value)]
                if "$(" in line or "`" in line:
                    # ${N} is not quoted in a here-document: in $(...) it would be split and globbed.
                    raise ValueError(
                        "a {{placeholder}} in a here-document must not share a line with $(...) or `...`"
                    )
                continue
            before = value[match.start() - 1] if match.start() else " "
            after = value[match.end()] if match.end() < len(value) else " "
            # "\{{x}}" would escape the opening quote of "$N", "${{x}}" would read $"..."; as a word
            # of its own a placeholder is always one literal argument.
            if before not in WORD_BEFORE or after not in WORD_AFTER:
                raise ValueError(
                    "in a command that needs a shell, each {{placeholder}} must be a word of its own"
                )
            if before != "=" and in_command_position(value, match.start()):
                raise ValueError("a {{placeholder}} must not be the program to run")
        return value


class CodeHandler(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    type: Literal["code"]
    language: Literal["python"] = "python"
    code: str = Field(min_length=1, max_length=65536)
    timeout_seconds: float = _timeout()


Handler = Annotated[HttpHandler | ShellHandler | CodeHandler, Field(discriminator="type")]


class CustomActionDef(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    id: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}$")
    name: str = Field(min_length=1, max_length=100)
    description: str = Field(min_length=1, max_length=2000)
    similes: list[Annotated[str, Field(min_length=1, max_length=100)]] = Field(
        default_factory=list, max_length=20
    )
    parameters: list[ParameterDef] = Field(default_factory=list, max_length=32)
    handler: Handler
    enabled: bool = True
    created_at: datetime | None = Field(default=None, alias="createdAt")
    updated_at: datetime | None = Field(default=None, alias="updatedAt")

    @field_validator("name")
    @classmethod
    def _screaming_snake(cls, value: str) -> str:
        if not ACTION_NAME.match(value):
            raise ValueError("must be SCREAMING_SNAKE_CASE, e.g. CHECK_WEATHER")
        return value

    @model_validator(mode="after")
    def _placeholders_declared(self) -> CustomActionDef:
        names = [p.name for p in self.parameters]
        if len(set(names)) != len(names):
            raise ValueError("parameters: a parameter name is declared twice")
        declared = set(names)
        for where, text in self.templates():
            if SPACED_PLACEHOLDER.search(PLACEHOLDER.sub("", text)):
                raise ValueError(f"{where}: {SPACED_MESSAGE}")
            for used in placeholders(text):
                if used.startswith(SECRET_PREFIX):
                    if not isinstance(self.handler, HttpHandler):
                        raise ValueError(f"{where}: {{{{secret:...}}}} is for http handlers only")
                elif used not in declared:
                    raise ValueError(f"{where}: {{{{{used}}}}} is not a declared parameter")
        return self

    def secret_refs(self) -> list[str]:
        """The setting names its templates read with ``{{secret:NAME}}``."""
        return sorted(
            {
                used.removeprefix(SECRET_PREFIX)
                for _, text in self.templates()
                for used in placeholders(text)
                if used.startswith(SECRET_PREFIX)
            }
        )

    def templates(self) -> list[tuple[str, str]]:
        h = self.handler
        if isinstance(h, HttpHandler):
            found = [("handler.url", h.url)]
            found += [(f"handler.headers.{k}", v) for k, v in h.headers.items()]
            if h.body_template is not None:
                found.append(("handler.bodyTemplate", h.body_template))
            return found
        if isinstance(h, ShellHandler):
            return [("handler.command", h.command)]
        return []

    def document(self) -> dict[str, Any]:
        return self.model_dump(mode="json", by_alias=True, exclude_none=True)

    def public_document(self) -> dict[str, Any]:
        """The definition for listings: header values that look like credentials are masked."""
        doc = self.document()
        headers = doc.get("handler", {}).get("headers")
        if headers:
            doc["handler"]["headers"] = {
                k: ("[REDACTED]" if SENSITIVE_HEADER.search(k) else v) for k, v in headers.items()
            }
        return doc

    def header_secrets(self) -> list[str]:
        """Literal header values that look like credentials, redacted from outputs."""
        h = self.handler
        if not isinstance(h, HttpHandler):
            return []
        return [v for k, v in h.headers.items() if SENSITIVE_HEADER.search(k) and not PLACEHOLDER.search(v)]


def describe_errors(exc: ValidationError) -> str:
    """``field.path: what is wrong`` for each error; the offending input is never included."""
    parts = []
    for err in exc.errors(include_input=False, include_url=False):
        where = ".".join(str(p) for p in err["loc"] if p not in ("http", "shell", "code"))
        msg = str(err["msg"]).removeprefix("Value error, ")
        parts.append(f"{where or '(definition)'}: {msg}")
    return "; ".join(parts)


def parse_definition(data: Any, origin: str = "custom action") -> CustomActionDef:
    if not isinstance(data, Mapping):
        raise errors.CUSTOM_ACTION_INVALID(f"{origin}: a custom action must be a mapping")
    try:
        return CustomActionDef.model_validate(dict(data))
    except ValidationError as exc:
        raise errors.CUSTOM_ACTION_INVALID(
            f"{origin}: {describe_errors(exc)}",
            hint="see docs/custom-actions.md for the fields of a definition",
        ) from None


def parse_definition_text(text: str, origin: str = "definition") -> CustomActionDef:
    if not text.strip():
        raise errors.DEFINITION_REQUIRED(f"{origin} is required (a JSON or YAML document)")
    if len(text) > 256_000:
        raise errors.DEFINITION_TOO_LARGE(f"{origin} is over 256 kB")
    try:
        data = yaml.safe_load(text)  # JSON is YAML too
    except yaml.YAMLError:
        raise errors.CUSTOM_ACTION_INVALID(f"{origin} is neither JSON nor YAML") from None
    return parse_definition(data, origin)


def parse_definitions(data: Any, origin: str) -> list[CustomActionDef]:
    """A config file's definitions: a list, or a mapping with a ``customActions`` list."""
    if isinstance(data, Mapping):
        data = data.get("customActions")
    if not isinstance(data, list):
        raise errors.CUSTOM_ACTION_INVALID(
            f"{origin}: expected a list of custom actions (or a mapping with customActions)"
        )
    found = [parse_definition(item, f"{origin}: customActions.{i}") for i, item in enumerate(data)]
    for key in ("id", "name"):
        values = [getattr(d, key) for d in found]
        duplicates = sorted({v for v in values if values.count(v) > 1})
        if duplicates:
            raise errors.CUSTOM_ACTION_INVALID(
                f"{origin}: customActions share the {key} {', '.join(duplicates)}"
            )
    return found
