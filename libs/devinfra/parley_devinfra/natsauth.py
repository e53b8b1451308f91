"""The NATS credentials of a development or test deployment: a random password per identity (each
service, the operator, NATS' system user) and the key pair the pairing service signs connector
admissions with (auth callout), kept in ``<state dir>/nats/auth.json`` (mode 0600); and the server
configuration built from them, with bcrypt hashes instead of the passwords."""

from __future__ import annotations

import json
import os
import secrets
from dataclasses import asdict, dataclass
from pathlib import Path
from urllib.parse import quote

import bcrypt
import nkeys

from parley_platform import permissions

AUTH_FILE = "auth.json"
CONFIG_FILE = "nats.conf"
# bcrypt's cost: each service connects once, and tests start many processes; 10 is ~50 ms.
BCRYPT_ROUNDS = 10


def _password() -> str:
    return secrets.token_urlsafe(24)


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
            passwords={name: _password() for name in permissions.IDENTITIES},
            system_password=_password(),
            callout_seed=new_account_seed(),
        )

    @property
    def callout_issuer(self) -> str:
        return public_key(self.callout_seed)

    def server_config(self) -> str:
        """The server's accounts and authorization (passwords as bcrypt hashes)."""

        def hashed(password: str) -> str:
            return bcrypt.hashpw(password.encode(), bcrypt.gensalt(BCRYPT_ROUNDS)).decode()

        return permissions.server_authorization(
            {name: hashed(pw) for name, pw in self.passwords.items()},
            system_password=hashed(self.system_password),
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
            passwords = {**auth.passwords, **{n: _password() for n in missing}}
            auth = cls(passwords, auth.system_password, auth.callout_seed)
            auth.save(path)
        config = directory / CONFIG_FILE
        fd = os.open(config, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as handle:
            handle.write(auth.server_config())
        return auth
