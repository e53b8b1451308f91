"""A connector's credentials: the JSON file `parley connectors add ... --out FILE` writes.

``Credentials.load(path)`` reads the file, ``Credentials.from_env()`` reads it from the file named
by ``PARLEY_CONNECTOR_CREDENTIALS`` or from ``PARLEY_CONNECTOR_<FIELD>`` variables (NAME,
NATS_URL, PASSWORD, AGENT_ID, SOURCE, NAMESPACE; the subjects follow from them), and
``Credentials(**fields)`` takes them as given. Errors name the field, never the password.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from parley_platform import permissions
from parley_platform.bus import Subjects

from . import codes

ENV_PREFIX = "PARLEY_CONNECTOR_"
_REQUIRED = ("name", "nats_url", "password", "agent_id", "source")


@dataclass(frozen=True)
class Credentials:
    """Who a connector is on the bus and where it publishes and reads; the subjects default to the
    ones its permissions allow (``parley_platform.permissions.connector``)."""

    name: str
    nats_url: str
    password: str
    agent_id: str
    source: str
    namespace: str = "parley"
    user: str = ""
    inbound_subject: str = ""
    outbound_subject: str = ""
    outbound_stream: str = ""
    durable: str = ""
    inbox_prefix: str = ""
    stream_subject: str = ""
    cancel_subject: str = ""
    api_key: str = ""

    def __post_init__(self) -> None:
        for key in _REQUIRED:
            if not getattr(self, key):
                raise codes.CREDENTIALS_INVALID(f"connector credentials lack {key!r}")
        subjects = Subjects(self.namespace)
        derived = {
            "user": self.name,
            "inbound_subject": subjects.inbound(self.agent_id, self.source),
            "outbound_subject": subjects.outbound(self.agent_id, self.source),
            "outbound_stream": subjects.stream("OUTBOUND"),
            "durable": permissions.connector_durable(self.name),
            "inbox_prefix": permissions.connector_inbox(self.name),
            "stream_subject": f"{self.namespace}.stream.{self.agent_id}.{self.source}",
            "cancel_subject": f"{self.namespace}.cancel.{self.agent_id}.{self.source}",
        }
        for key, value in derived.items():
            if not getattr(self, key):
                object.__setattr__(self, key, value)

    def __repr__(self) -> str:  # the password and API key stay out of logs and tracebacks
        return f"Credentials(name={self.name!r}, agent_id={self.agent_id!r}, source={self.source!r})"

    @classmethod
    def from_dict(cls, data: Any, *, origin: str = "connector credentials") -> Credentials:
        if not isinstance(data, dict):
            raise codes.CREDENTIALS_INVALID(f"{origin}: not a JSON object")
        known = {f.name for f in fields(cls)}
        values: dict[str, str] = {}
        for key in known & data.keys():
            value = data[key]
            if not isinstance(value, str):
                raise codes.CREDENTIALS_INVALID(f"{origin}: {key!r} is not a string")
            values[key] = value
        missing = [key for key in _REQUIRED if not values.get(key)]
        if missing:
            raise codes.CREDENTIALS_INVALID(f"{origin} lack {', '.join(repr(m) for m in missing)}")
        return cls(**values)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Credentials:
        """The credentials in ``path`` (the file `parley connectors add --out` writes)."""
        try:
            text = Path(path).read_text()
        except OSError as exc:
            raise codes.CREDENTIALS_INVALID(f"cannot read {path}: {exc.strerror}") from None
        try:
            data = json.loads(text)
        except ValueError:
            raise codes.CREDENTIALS_INVALID(f"{path} is not JSON") from None
        return cls.from_dict(data, origin=str(path))

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None, prefix: str = ENV_PREFIX) -> Credentials:
        """From the file ``<prefix>CREDENTIALS`` names, else from ``<prefix><FIELD>`` variables."""
        env = dict(os.environ if environ is None else environ)
        path = env.get(f"{prefix}CREDENTIALS")
        if path:
            return cls.load(path)
        values = {
            f.name: env[f"{prefix}{f.name.upper()}"]
            for f in fields(cls)
            if f"{prefix}{f.name.upper()}" in env
        }
        if not values:
            raise codes.CREDENTIALS_INVALID(
                f"no connector credentials in the environment: set {prefix}CREDENTIALS to the file "
                f"`parley connectors add --out` wrote, or {prefix}NAME, {prefix}NATS_URL, ..."
            )
        return cls.from_dict(values, origin="the environment's connector credentials")
