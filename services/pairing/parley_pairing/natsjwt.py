"""NATS JWTs (``ed25519-nkey``), as far as the auth callout needs them: decode and verify the
server's authorization request, encode the user and the authorization response it answers with.

The format is nats-io/jwt's v2: ``base64url(header).base64url(claims).base64url(signature)``
without padding, the signature over the first two parts by the issuer's nkey, ``jti`` the base32
SHA-512/256 of the claims."""

from __future__ import annotations

import base64
import hashlib
import json
import time
from typing import Any

import nacl.exceptions
import nacl.signing
import nkeys

HEADER = {"typ": "JWT", "alg": "ed25519-nkey"}
VERSION = 2


class JwtError(ValueError):
    """A token that does not decode or whose signature does not verify."""


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def _json(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":")).encode()


def public_key_bytes(public: str) -> bytes:
    """The raw ed25519 key of an encoded nkey public key (prefix byte, 32 bytes, CRC-16)."""
    try:
        raw = base64.b32decode(public + "=" * (-len(public) % 8))
    except (ValueError, TypeError) as exc:
        raise JwtError("issuer is not an nkey") from exc
    if len(raw) != 35:
        raise JwtError("issuer is not an nkey")
    return raw[1:33]


def decode(token: str) -> dict[str, Any]:
    """The claims of ``token``, after checking its signature by its issuer (``iss``)."""
    parts = token.split(".")
    if len(parts) != 3:
        raise JwtError("a JWT has three parts")
    try:
        claims = json.loads(_unb64(parts[1]))
        signature = _unb64(parts[2])
    except ValueError as exc:
        raise JwtError("the JWT does not decode") from exc
    if not isinstance(claims, dict) or not isinstance(claims.get("iss"), str):
        raise JwtError("the JWT names no issuer")
    try:
        nacl.signing.VerifyKey(public_key_bytes(claims["iss"])).verify(
            f"{parts[0]}.{parts[1]}".encode(), signature
        )
    except (nacl.exceptions.BadSignatureError, nacl.exceptions.ValueError) as exc:
        raise JwtError("the JWT's signature does not verify") from exc
    return claims


def encode(claims: dict[str, Any], signer: nkeys.KeyPair) -> str:
    """Sign ``claims`` as ``signer`` (its public key becomes ``iss``)."""
    body = {**claims, "iss": signer.public_key.decode(), "iat": int(time.time())}
    body.pop("jti", None)
    digest = hashlib.new("sha512_256", _json(body)).digest()
    body["jti"] = base64.b32encode(digest).rstrip(b"=").decode()
    signing = f"{_b64(_json(HEADER))}.{_b64(_json(body))}"
    return f"{signing}.{_b64(signer.sign(signing.encode()))}"


def user_claims(
    user_nkey: str, *, name: str, account: str, publish: list[str], subscribe: list[str], expires: int = 0
) -> dict[str, Any]:
    claims: dict[str, Any] = {
        "sub": user_nkey,
        "name": name,
        "aud": account,  # config mode: the account the user is placed in
        "nats": {
            "pub": {"allow": publish},
            "sub": {"allow": subscribe},
            "subs": -1,
            "data": -1,
            "payload": -1,
            "type": "user",
            "version": VERSION,
        },
    }
    if expires:
        claims["exp"] = expires
    return claims


def response_claims(user_nkey: str, server_id: str, *, user_jwt: str = "", error: str = "") -> dict[str, Any]:
    nats: dict[str, Any] = {"type": "authorization_response", "version": VERSION}
    if user_jwt:
        nats["jwt"] = user_jwt
    else:
        nats["error"] = error
    return {"sub": user_nkey, "aud": server_id, "nats": nats}
