"""An MCP server as a character names it, in the common ``mcpServers`` shape: ``{"command", "args",
"env"}`` for a stdio server, ``{"url", "headers"}`` for a streamable HTTP one. Header and env values
may be ``{{secret:NAME}}``: the agent's setting NAME (its encrypted secrets first), read when the
session is opened, never stored in the character."""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Mapping
from typing import Any
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from parley_platform.errors import InvalidArgument

from . import errors
from .custom.definitions import SENSITIVE_HEADER

SERVER_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_-]{0,31}$")
SECRET = re.compile(r"\{\{secret:([A-Za-z_][A-Za-z0-9_]*)\}\}")


class McpServerDef(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    command: str | None = Field(default=None, min_length=1, max_length=4096)
    args: list[str] = Field(default_factory=list, max_length=256)
    env: dict[str, str] = Field(default_factory=dict)
    url: str | None = Field(default=None, min_length=1, max_length=2048)
    headers: dict[str, str] = Field(default_factory=dict)
    # Tools with destructiveHint wait for a person's confirmation unless this (or the runtime's
    # PARLEY_MCP_CONFIRM_DESTRUCTIVE=false) says otherwise.
    confirm_destructive: bool = Field(default=True, alias="confirmDestructive")
    enabled: bool = True

    @model_validator(mode="after")
    def _one_transport(self) -> McpServerDef:
        if (self.command is None) == (self.url is None):
            raise ValueError("give either command (a stdio server) or url (a streamable HTTP server)")
        if self.url is not None:
            if self.args or self.env:
                raise ValueError("args and env are for stdio servers (command), not url")
            parts = urlsplit(self.url)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise ValueError("url must be an http(s) URL with a host")
            if parts.username or parts.password:
                raise ValueError("url must not hold credentials: put them in headers, as {{secret:NAME}}")
        elif self.headers:
            raise ValueError("headers are for streamable HTTP servers (url), not command")
        return self

    @property
    def transport(self) -> str:
        return "stdio" if self.command is not None else "http"

    def document(self) -> dict[str, Any]:
        return self.model_dump(mode="json", by_alias=True, exclude_defaults=True)

    def public_document(self) -> dict[str, Any]:
        """As listed: header and env values that look like credentials masked, placeholders kept."""
        doc = self.document()
        for key in ("headers", "env"):
            if key in doc:
                doc[key] = {
                    k: v if SECRET.fullmatch(v) or not SENSITIVE_HEADER.search(k) else "***"
                    for k, v in doc[key].items()
                }
        return doc

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(self.document(), sort_keys=True).encode()).hexdigest()[:16]

    def resolve(self, values: Mapping[str, str], setting: Callable[[str], object | None]) -> dict[str, str]:
        """``values`` with each ``{{secret:NAME}}`` replaced by the agent's setting NAME."""
        resolved = {}
        for key, value in values.items():
            for secret in SECRET.findall(value):
                if setting(secret) is None:
                    raise errors.MCP_SECRET_MISSING(
                        f"{key}: the agent has no setting {secret} (add it to its secrets)"
                    )
            resolved[key] = SECRET.sub(lambda m: str(setting(m.group(1))), value)
        return resolved


def check_name(name: str, where: str = "name") -> str:
    if not SERVER_NAME.match(name):
        raise errors.MCP_SERVER_INVALID(
            f"{where}: an MCP server's name is a letter, then up to 31 letters, digits, '_' or '-'"
        )
    return name


def parse_server(name: str, data: Any, where: str = "mcpServers") -> McpServerDef:
    check_name(name, f"{where} key")
    try:
        return McpServerDef.model_validate(data)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or name}: {e['msg'].removeprefix('Value error, ')}"
            for e in exc.errors()
        )
        raise errors.MCP_SERVER_INVALID(f"{where}.{name}: {problems}") from None


def parse_server_text(name: str, text: str) -> McpServerDef:
    try:
        data = json.loads(text)
    except ValueError:
        raise errors.MCP_SERVER_INVALID("definition_json is not valid JSON") from None
    return parse_server(name, data, "definition")


__all__ = ["InvalidArgument", "McpServerDef", "check_name", "parse_server", "parse_server_text"]
