"""The NATS credentials of a development or test deployment: a random password per identity (each
service, the operator, NATS' system user) and the key pair the pairing service signs connector
admissions with (auth callout), kept in ``<state dir>/nats/auth.json`` (mode 0600); and the server
configuration built from them, beside it and as private.

The server compares plain passwords, not bcrypt hashes: the plain ones sit in auth.json next to the
configuration anyway, and the server's bcrypt check costs tens of milliseconds of CPU per
connection, which turned 40 simultaneous connections into 5-second handshakes on a 2-core machine.
Connectors' passwords are never in a configuration: pairing keeps only their digests."""

from __future__ import annotations

import json
import os
import secrets
import string
from dataclasses import asdict, dataclass
from pathlib import Path
from urllib.parse import quote

import nkeys

from parley_platform import permissions

ALPHABET = string.ascii_letters + string.digits
AUTH_FILE = "auth.json"
CONFIG_FILE = "nats.conf"


def new_password() -> str:
    """32 letters and digits, a letter first (~190 bits): the NATS server parses a password it reads
    from the environment (``$NAME`` in deploy/nats-auth.conf) as a config value, where a leading digit
    starts a number and punctuation can end the token."""
    return secrets.choice(string.ascii_letters) + "".join(secrets.choice(ALPHABET) for _ in range(31))


def new_account_seed() -> str:
    """An nkey account seed (``SA…``): the auth callout's issuer."""
    return str(nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_ACCOUNT).decode())


def public_key(seed: str) -> str:
    return str(nkeys.from_seed(seed.encode()).public_key.decode())


@dataclass(frozen=True)
class NatsAuth:
    passwords: dict[str, str]  # identity -> password
    system_password: str
    callout_seed: str  # the pairing service signs connector admissions with it; secret

    @classmethod
    def generate(cls) -> NatsAuth:
        return cls(
            passwords={name: new_password() for name in permissions.IDENTITIES},
            system_password=new_password(),
            callout_seed=new_account_seed(),
        )

    @property
    def callout_issuer(self) -> str:
        return public_key(self.callout_seed)

    def server_config(self) -> str:
        """The server's accounts and authorization."""
        return permissions.server_authorization(
            self.passwords,
            system_password=self.system_password,
            callout_issuer=self.callout_issuer,
        )

    def url(self, base: str, identity: str) -> str:
        """``base`` with ``identity``'s credentials in it (what the tests' clients connect with)."""
        scheme, _, rest = base.partition("://")
        user, password = quote(identity, safe=""), quote(self.passwords[identity], safe="")
        return f"{scheme}://{user}:{password}@{rest}"

    def services_env(self) -> dict[str, str]:
        """What the service processes of this deployment need, each picking its own
        (``PARLEY_<IDENTITY>_NATS_PASSWORD``; the pairing service's callout key and system password)."""
        env = {f"PARLEY_{name.upper()}_NATS_PASSWORD": self.passwords[name] for name in permissions.SERVICES}
        env.update(
            PARLEY_PAIRING_CALLOUT_SEED=self.callout_seed, PARLEY_PAIRING_SYSTEM_PASSWORD=self.system_password
        )
        return env

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as handle:
            json.dump(asdict(self), handle, indent=2)

    @classmethod
    def load(cls, path: Path) -> NatsAuth:
        data = json.loads(path.read_text())
        return cls(
            passwords=dict(data["passwords"]),
            system_password=data["system_password"],
            callout_seed=data["callout_seed"],
        )

    @classmethod
    def ensure(cls, directory: Path) -> NatsAuth:
        """The credentials kept in ``directory`` (generated on first use, completed when an identity
        was added since), with the server configuration written beside them."""
        path = directory / AUTH_FILE
        auth = cls.load(path) if path.exists() else cls.generate()
        missing = [name for name in permissions.IDENTITIES if name not in auth.passwords]
        if missing or not path.exists():
            passwords = {**auth.passwords, **{n: new_password() for n in missing}}
            auth = cls(passwords, auth.system_password, auth.callout_seed)
            auth.save(path)
        config = directory / CONFIG_FILE
        fd = os.open(config, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as handle:
            handle.write(auth.server_config())
        return auth
