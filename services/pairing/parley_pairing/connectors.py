"""Connectors as the pairing service knows them: what a connector is, the checks on what an
operator asks for, and its secrets (random, shown once, stored as SHA-256 digests: they are
high-entropy tokens, not passwords people choose, so a slow hash would buy nothing)."""

from __future__ import annotations

import hashlib
import re
import secrets
import uuid
from dataclasses import dataclass
from datetime import datetime

from parley_platform import permissions

from . import errors

NAME = re.compile(r"[a-z][a-z0-9_-]{0,62}")
SOURCE = re.compile(r"[A-Za-z0-9_-]{1,64}")
KINDS = ("nats", "web")
RESERVED = frozenset({*permissions.IDENTITIES, permissions.SYSTEM_USER})


@dataclass(frozen=True)
class Connector:
    name: str
    namespace: str
    agent_id: uuid.UUID
    source: str
    kind: str
    created_at: datetime
    revoked_at: datetime | None = None

    def permissions(self) -> permissions.Permissions:
        return permissions.connector(self.namespace, str(self.agent_id), self.source, self.name)


@dataclass(frozen=True)
class Issued:
    """A new connector and the secrets it is given once."""

    connector: Connector
    password: str
    api_key: str = ""


def check_name(name: str) -> str:
    if not NAME.fullmatch(name) or name in RESERVED:
        raise errors.INVALID_CONNECTOR_NAME(f"connector name {name[:64]!r} is not allowed")
    return name


def check_source(source: str) -> str:
    if not SOURCE.fullmatch(source):
        raise errors.INVALID_SOURCE("source must be 1-64 letters, digits, '_' or '-'")
    return source


def check_kind(kind: str) -> str:
    kind = kind or "nats"
    if kind not in KINDS:
        raise errors.INVALID_CONNECTOR_KIND(f"kind must be one of {', '.join(KINDS)}")
    return kind


def new_secret() -> str:
    return secrets.token_urlsafe(32)


def digest(secret: str) -> bytes:
    return hashlib.sha256(secret.encode()).digest()
