"""Agent secrets: encryption at rest, the secret-salt start-up check, and redaction.

Encryption is AES-256-GCM. A token is ``"v1:" + urlsafe_b64(nonce(12) + ciphertext + tag(16))``
and its associated data is ``b"parley-secret:v1:" + name``, so a token only decrypts under the
format version and the secret name it was made for: a ciphertext copied onto another key name (or
replayed as another format) fails authentication instead of silently handing one secret's value to
another setting. Callers that want a token bound to one agent too put the agent id in the name.

Key derivation: scrypt (N=2**15, r=8, p=1, 32 MiB, about 0.1 s) over the operator's
``PARLEY_SECRET_SALT``, not HKDF. Despite its name, the "salt" is the only key material, and it is
typed by a person: often a phrase, not 32 random bytes. HKDF is a key *expander* that assumes a
high-entropy input; with it, anyone holding a database dump tests millions of guessed phrases per
second per core. scrypt makes each guess cost 0.1 s and 32 MiB, which also defeats GPUs. The price
is paid once per process, because a ``SecretBox`` is built once and shared. The scrypt salt is a
fixed domain-separation label (there is nowhere to keep a random one apart from the secret it
would protect); per-deployment uniqueness comes from the secret salt itself. Changing the KDF, its
parameters or the token layout means a new format version (``v2:``), never an in-place change.

Nonces are 96 random bits per encryption, safe for far more than the 2**32 encryptions NIST
allows per key with random nonces; a deployment stores a few secrets per agent.

Nothing here logs, and no error message includes a token, a plaintext or the salt.
"""

from __future__ import annotations

import base64
import binascii
import os
import re
from collections.abc import Iterable, Mapping
from typing import Any, Final, TypeVar, cast

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.scrypt import Scrypt

from parley_platform.errors import FailedPrecondition

from . import errors

__all__ = [
    "DEFAULT_SECRET_SALT",
    "REDACTED",
    "Redactor",
    "SecretBox",
    "SecretDecryptFailed",
    "check_salt",
]

DEFAULT_SECRET_SALT: Final = "parley-default-secret-salt"
REDACTED: Final = "[REDACTED]"

_VERSION: Final = "v1"
_PREFIX: Final = _VERSION + ":"
_AAD_PREFIX: Final = b"parley-secret:" + _VERSION.encode() + b":"
_KDF_SALT: Final = b"parley-secrets-v1"
_SCRYPT_N: Final = 2**15
_SCRYPT_R: Final = 8
_SCRYPT_P: Final = 1
_NONCE_BYTES: Final = 12
_TAG_BYTES: Final = 16
_DECRYPT_HINT: Final = (
    "the secret salt changed since the secret was stored, or the stored value was altered or belongs "
    "to another secret name; restore PARLEY_SECRET_SALT or set the secret again"
)
# Lone surrogates are valid Python text; "surrogatepass" lets every str round-trip instead of
# making encrypt() fail on text that came from a lenient decoder.
_TEXT_ERRORS: Final = "surrogatepass"


class SecretDecryptFailed(FailedPrecondition):
    """A stored secret cannot be decrypted with this deployment's key under this name."""

    default_code = errors.SECRET_DECRYPT_FAILED.code


class SecretBox:
    """Encrypts and decrypts secret values with a key derived from the secret salt."""

    __slots__ = ("_aead",)

    def __init__(self, salt: str) -> None:
        if not salt:
            raise errors.SECRET_SALT_EMPTY("the secret salt is empty")
        kdf = Scrypt(salt=_KDF_SALT, length=32, n=_SCRYPT_N, r=_SCRYPT_R, p=_SCRYPT_P)
        self._aead = AESGCM(kdf.derive(salt.encode("utf-8", _TEXT_ERRORS)))

    def __repr__(self) -> str:
        return f"SecretBox({_VERSION})"

    def encrypt(self, plaintext: str, *, name: str) -> str:
        nonce = os.urandom(_NONCE_BYTES)
        sealed = self._aead.encrypt(nonce, plaintext.encode("utf-8", _TEXT_ERRORS), _aad(name))
        return _PREFIX + base64.urlsafe_b64encode(nonce + sealed).decode("ascii")

    def decrypt(self, token: str, *, name: str) -> str:
        if not token.startswith(_PREFIX):
            raise _decrypt_failed(name, f"it is not a {_VERSION} secret token")
        body = token[len(_PREFIX) :]
        try:
            raw = base64.b64decode(body, altchars=b"-_", validate=True)
        except (binascii.Error, ValueError) as exc:
            raise _decrypt_failed(name, "the token is not valid base64") from exc
        # base64 ignores the spare low bits of the last symbol; insisting on the canonical
        # spelling makes any edit to the token fail, not only edits the decoder happens to see.
        if base64.urlsafe_b64encode(raw).decode("ascii") != body:
            raise _decrypt_failed(name, "the token is not canonical base64")
        if len(raw) < _NONCE_BYTES + _TAG_BYTES:
            raise _decrypt_failed(name, "the token is too short")
        try:
            plain = self._aead.decrypt(raw[:_NONCE_BYTES], raw[_NONCE_BYTES:], _aad(name))
        except InvalidTag as exc:
            raise _decrypt_failed(name, "authentication failed") from exc
        return plain.decode("utf-8", _TEXT_ERRORS)


def _aad(name: str) -> bytes:
    return _AAD_PREFIX + name.encode("utf-8", _TEXT_ERRORS)


def _decrypt_failed(name: str, why: str) -> SecretDecryptFailed:
    return SecretDecryptFailed(f"cannot decrypt secret {name!r}: {why}", hint=_DECRYPT_HINT)


def check_salt(salt: str | None, *, environment: str, allow_default: bool) -> str:
    """The secret salt to use, refusing the public default in production.

    A blank salt counts as missing. In ``development`` and ``test`` a missing salt means the
    default. Any other environment is treated as production, so a misspelt environment fails
    closed. ``allow_default`` (``PARLEY_ALLOW_DEFAULT_SECRET_SALT=true``) accepts the risk.
    """
    if salt is not None and salt.strip() and salt != DEFAULT_SECRET_SALT:
        return salt
    if allow_default or environment in ("development", "test"):
        return DEFAULT_SECRET_SALT
    what = "is the public default" if salt == DEFAULT_SECRET_SALT else "is not set"
    raise errors.DEFAULT_SECRET_SALT(
        f"PARLEY_SECRET_SALT {what} in {environment}: anyone could decrypt the stored agent secrets"
    )


_T = TypeVar("_T")
_END: Final = ""  # marks a trie node where a secret ends; never a character key
# Deeper trie levels are emitted as one flat alternation, so a pathological set of secrets
# (aaaa, aaaaa, aaaaaa, ...) cannot nest groups past what the regex compiler can parse.
_MAX_NESTING: Final = 64
_MIN_SECRET_LENGTH: Final = 4


class Redactor:
    """Replaces every occurrence of a secret value in text (and in JSON-like data) with ``[REDACTED]``.

    Values shorter than four characters are ignored: redacting ``"a"`` or ``"no"`` would mangle text
    and protect nothing. At each position the longest secret that starts there is redacted, so a
    secret that extends another is removed whole. The secrets compile into one regular expression
    shaped as a trie (``abc(?:d|ef)``), so each position of the text costs about the length of the
    longest secret, not the number of secrets.
    """

    __slots__ = ("_pattern", "longest")

    def __init__(self, values: Iterable[str]) -> None:
        kept = {v for v in values if len(v) >= _MIN_SECRET_LENGTH}
        self._pattern = re.compile(_trie_pattern(kept)) if kept else None
        self.longest = max((len(v) for v in kept), default=0)  # what a streamed text holds back

    def spans(self, text: str) -> list[tuple[int, int]]:
        """Where ``redact`` would replace, in order."""
        if self._pattern is None:
            return []
        return [m.span() for m in self._pattern.finditer(text)]

    def __repr__(self) -> str:
        return f"Redactor(active={self._pattern is not None})"

    def __bool__(self) -> bool:
        return self._pattern is not None

    def redact(self, text: str) -> str:
        if self._pattern is None:
            return text
        return self._pattern.sub(REDACTED, text)

    def redact_obj(self, obj: _T) -> _T:
        """``obj`` with every str inside dicts, lists and tuples redacted; keys are left alone.

        Containers are rebuilt (a dict subclass comes back as a dict); other values are returned
        as they are. With no secrets the very object passed in is returned.
        """
        if self._pattern is None:
            return obj
        return cast(_T, self._redact_any(obj))

    def _redact_any(self, obj: object) -> object:
        if isinstance(obj, str):
            return self.redact(obj)
        if isinstance(obj, Mapping):
            return {k: self._redact_any(v) for k, v in obj.items()}
        if isinstance(obj, list):
            return [self._redact_any(v) for v in obj]
        if isinstance(obj, tuple):
            items = [self._redact_any(v) for v in obj]
            make = getattr(type(obj), "_make", None)  # keep named tuples named
            return make(items) if make is not None else tuple(items)
        return obj


def _trie_pattern(values: set[str]) -> str:
    root: dict[str, Any] = {}
    for value in values:
        node = root
        for ch in value:
            node = node.setdefault(ch, {})
        node[_END] = {}
    return _node_pattern(root, 0)


def _node_pattern(node: dict[str, Any], nesting: int) -> str:
    """The pattern for the suffixes below ``node``, longest match first."""
    if nesting >= _MAX_NESTING:
        return _flat_pattern(node)
    branches = []
    for ch in sorted(k for k in node if k != _END):
        run, child = [ch], node[ch]
        while _END not in child and len(child) == 1:  # an unbranching chain is one literal
            ((next_ch, child),) = child.items()
            run.append(next_ch)
        branches.append(re.escape("".join(run)) + _node_pattern(child, nesting + 1))
    if not branches:
        return ""
    body = branches[0] if len(branches) == 1 and _END not in node else "(?:" + "|".join(branches) + ")"
    # Greedy "?" tries the longer secrets first and falls back to the one ending here.
    return body + "?" if _END in node else body


def _flat_pattern(node: dict[str, Any]) -> str:
    suffixes: list[str] = []
    stack: list[tuple[str, dict[str, Any]]] = [("", node)]
    while stack:
        prefix, current = stack.pop()
        for ch, child in current.items():
            if ch == _END:
                suffixes.append(prefix)
            else:
                stack.append((prefix + ch, child))
    optional = "" in suffixes
    longest_first = sorted((s for s in suffixes if s), key=len, reverse=True)
    if not longest_first:
        return ""
    body = "(?:" + "|".join(re.escape(s) for s in longest_first) + ")"
    return body + "?" if optional else body
