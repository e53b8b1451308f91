from __future__ import annotations

import base64
import random
import re
import string
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, NamedTuple

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from parley_platform.errors import FailedPrecondition, InvalidArgument, Kind
from parley_runtime.secrets import (
    DEFAULT_SECRET_SALT,
    REDACTED,
    Redactor,
    SecretBox,
    SecretDecryptFailed,
    check_salt,
)

BOUNDED = settings(max_examples=200, deadline=None)

# Deriving a key costs ~0.1 s by design (scrypt), so the boxes are built once per module.
BOX = SecretBox("salt-for-tests-0123456789")
OTHER_BOX = SecretBox("another-salt-for-tests-0123456789")


def raw_of(token: str) -> bytes:
    assert token.startswith("v1:")
    return base64.urlsafe_b64decode(token[3:])


def token_of(raw: bytes) -> str:
    return "v1:" + base64.urlsafe_b64encode(raw).decode()


REASONS = {
    "it is not a v1 secret token",
    "the token is not valid base64",
    "the token is not canonical base64",
    "the token is too short",
    "authentication failed",
}


def assert_decrypt_fails(box: SecretBox, token: str, name: str) -> None:
    with pytest.raises(SecretDecryptFailed) as info:
        box.decrypt(token, name=name)
    err = info.value
    assert err.code == "SECRET_DECRYPT_FAILED"
    assert err.kind is Kind.FAILED_PRECONDITION
    assert not err.retryable
    # The message is a fixed template around the secret's name: no token, no plaintext, no salt.
    prefix = f"cannot decrypt secret {name!r}: "
    assert err.message.startswith(prefix)
    assert err.message.removeprefix(prefix) in REASONS
    assert err.hint.startswith("the secret salt changed")


# ---------------------------------------------------------------- SecretBox


@BOUNDED
@given(plaintext=st.text(), name=st.text())
def test_encrypt_decrypt_round_trips(plaintext: str, name: str) -> None:
    token = BOX.encrypt(plaintext, name=name)
    assert token.startswith("v1:")
    assert BOX.decrypt(token, name=name) == plaintext


@BOUNDED
@given(
    plaintext=st.text(alphabet=st.characters(exclude_categories=())),
    name=st.text(alphabet=st.characters(exclude_categories=())),
)
def test_round_trip_includes_lone_surrogates(plaintext: str, name: str) -> None:
    assert BOX.decrypt(BOX.encrypt(plaintext, name=name), name=name) == plaintext


def test_token_layout_is_version_nonce_ciphertext_and_tag() -> None:
    token = BOX.encrypt("hunter2-secret", name="OPENAI_API_KEY")
    raw = raw_of(token)
    assert len(raw) == 12 + len(b"hunter2-secret") + 16
    assert b"hunter2-secret" not in raw
    assert token[3:] == base64.urlsafe_b64encode(raw).decode()  # urlsafe alphabet, padded


def test_a_box_built_from_the_same_salt_decrypts() -> None:
    token = BOX.encrypt("sk-live-abcdef", name="KEY")
    assert SecretBox("salt-for-tests-0123456789").decrypt(token, name="KEY") == "sk-live-abcdef"


def test_each_encryption_uses_a_fresh_nonce() -> None:
    tokens = [BOX.encrypt("same value", name="KEY") for _ in range(200)]
    assert len(set(tokens)) == len(tokens)
    assert len({raw_of(t)[:12] for t in tokens}) == len(tokens)


@BOUNDED
@given(plaintext=st.text(), name=st.text(), data=st.data())
def test_flipping_any_bit_of_the_payload_fails(plaintext: str, name: str, data: st.DataObject) -> None:
    raw = bytearray(raw_of(BOX.encrypt(plaintext, name=name)))
    index = data.draw(st.integers(0, len(raw) - 1), label="byte")
    raw[index] ^= 1 << data.draw(st.integers(0, 7), label="bit")
    assert_decrypt_fails(BOX, token_of(bytes(raw)), name)


@BOUNDED
@given(plaintext=st.text(), name=st.text(), data=st.data())
def test_changing_any_character_of_the_token_fails(plaintext: str, name: str, data: st.DataObject) -> None:
    token = BOX.encrypt(plaintext, name=name)
    index = data.draw(st.integers(0, len(token) - 1), label="position")
    replacement = data.draw(st.characters().filter(lambda c: c != token[index]), label="replacement")
    tampered = token[:index] + replacement + token[index + 1 :]
    assert_decrypt_fails(BOX, tampered, name)


@BOUNDED
@given(plaintext=st.text(), name=st.text(), data=st.data())
def test_truncating_or_extending_the_token_fails(plaintext: str, name: str, data: st.DataObject) -> None:
    token = BOX.encrypt(plaintext, name=name)
    cut = data.draw(st.integers(0, len(token) - 1), label="cut")
    assert_decrypt_fails(BOX, token[:cut], name)
    raw = raw_of(token)
    assert_decrypt_fails(BOX, token_of(raw + data.draw(st.binary(min_size=1, max_size=8))), name)
    assert_decrypt_fails(BOX, token_of(raw[:-1]), name)


@BOUNDED
@given(plaintext=st.text(), name=st.text(), other=st.text())
def test_a_token_does_not_move_to_another_name(plaintext: str, name: str, other: str) -> None:
    token = BOX.encrypt(plaintext, name=name)
    if other != name:
        assert_decrypt_fails(BOX, token, other)


def test_a_token_does_not_move_to_another_salt() -> None:
    token = BOX.encrypt("sk-live-abcdef", name="OPENAI_API_KEY")
    assert_decrypt_fails(OTHER_BOX, token, "OPENAI_API_KEY")


def test_the_associated_data_names_the_version_and_the_name() -> None:
    # Built by hand with the documented key derivation inputs, so the format is pinned down:
    # a v1 token made with other associated data (no version, or no name) must not decrypt.
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM
    from cryptography.hazmat.primitives.kdf.scrypt import Scrypt

    key = Scrypt(salt=b"parley-secrets-v1", length=32, n=2**15, r=8, p=1).derive(b"salt-for-tests-0123456789")
    aead, nonce = AESGCM(key), b"\x01" * 12
    good = token_of(nonce + aead.encrypt(nonce, b"value", b"parley-secret:v1:KEY"))
    assert BOX.decrypt(good, name="KEY") == "value"
    for aad in (b"KEY", b"parley-secret:KEY", b"parley-secret:v2:KEY", b"", None):
        assert_decrypt_fails(BOX, token_of(nonce + aead.encrypt(nonce, b"value", aad)), "KEY")


@pytest.mark.parametrize(
    "token",
    [
        "",
        "v1:",
        "v1",
        "v2:" + base64.urlsafe_b64encode(b"\0" * 40).decode(),
        "V1:" + base64.urlsafe_b64encode(b"\0" * 40).decode(),
        "plaintext-secret-value",
        "v1:not base64!",
        "v1:" + base64.urlsafe_b64encode(b"\0" * 27).decode(),  # shorter than nonce + tag
        "v1:" + base64.urlsafe_b64encode(b"\0" * 28).decode(),  # an empty ciphertext, wrong tag
        "v1:" + base64.urlsafe_b64encode(b"\0" * 40).decode().rstrip("="),
        "v1:" + base64.b64encode(b"\xfb\xff" * 20).decode(),  # "+" and "/": not the urlsafe spelling
        "v1:ünïcode",
    ],
)
def test_malformed_tokens_fail_with_the_stable_code(token: str) -> None:
    assert_decrypt_fails(BOX, token, "KEY")


def test_the_decrypt_error_names_the_secret_but_not_the_token() -> None:
    token = BOX.encrypt("sk-live-abcdef", name="OPENAI_API_KEY")
    with pytest.raises(SecretDecryptFailed) as info:
        BOX.decrypt(token, name="ANTHROPIC_API_KEY")
    shown = f"{info.value} {info.value.to_proto()}"
    assert "ANTHROPIC_API_KEY" in info.value.message
    assert token not in shown
    assert token[3:20] not in shown
    assert "sk-live-abcdef" not in shown
    assert "salt" in info.value.hint
    assert isinstance(info.value, FailedPrecondition)


def test_an_empty_salt_is_refused() -> None:
    with pytest.raises(InvalidArgument) as info:
        SecretBox("")
    assert info.value.code == "SECRET_SALT_EMPTY"


def test_repr_shows_no_key_material() -> None:
    assert repr(BOX) == "SecretBox(v1)"
    assert "salt-for-tests" not in repr(BOX)


# ---------------------------------------------------------------- check_salt

MISSING = [None, "", "   ", "\n"]


@pytest.mark.parametrize(
    ("salt", "environment", "allow_default", "expected"),
    [
        *[(s, "development", False, DEFAULT_SECRET_SALT) for s in MISSING],
        *[(s, "test", False, DEFAULT_SECRET_SALT) for s in MISSING],
        *[(s, "production", True, DEFAULT_SECRET_SALT) for s in MISSING],
        (DEFAULT_SECRET_SALT, "development", False, DEFAULT_SECRET_SALT),
        (DEFAULT_SECRET_SALT, "test", False, DEFAULT_SECRET_SALT),
        (DEFAULT_SECRET_SALT, "production", True, DEFAULT_SECRET_SALT),
        ("a-real-salt", "development", False, "a-real-salt"),
        ("a-real-salt", "test", True, "a-real-salt"),
        ("a-real-salt", "production", False, "a-real-salt"),
        ("a-real-salt", "production", True, "a-real-salt"),
        (" spaced salt ", "production", False, " spaced salt "),  # used as given, never trimmed
    ],
)
def test_check_salt_accepts(salt: str | None, environment: str, allow_default: bool, expected: str) -> None:
    assert check_salt(salt, environment=environment, allow_default=allow_default) == expected


@pytest.mark.parametrize(
    ("salt", "environment", "what"),
    [
        *[(s, "production", "is not set") for s in MISSING],
        (DEFAULT_SECRET_SALT, "production", "is the public default"),
        (None, "staging", "is not set"),  # an unknown environment is treated as production
        (DEFAULT_SECRET_SALT, "Production", "is the public default"),
    ],
)
def test_check_salt_refuses_the_default_in_production(salt: str | None, environment: str, what: str) -> None:
    with pytest.raises(FailedPrecondition) as info:
        check_salt(salt, environment=environment, allow_default=False)
    err = info.value
    assert err.code == "DEFAULT_SECRET_SALT"
    assert what in err.message
    assert "PARLEY_SECRET_SALT" in err.hint
    assert "PARLEY_ALLOW_DEFAULT_SECRET_SALT=true" in err.hint
    assert DEFAULT_SECRET_SALT not in str(err)


def test_check_salt_takes_the_settings_enum() -> None:
    from parley_platform.settings import Environment

    assert check_salt(None, environment=Environment.TEST, allow_default=False) == DEFAULT_SECRET_SALT
    with pytest.raises(FailedPrecondition):
        check_salt(None, environment=Environment.PRODUCTION, allow_default=False)


# ---------------------------------------------------------------- Redactor


def reference_redact(text: str, values: list[str]) -> str:
    """Leftmost, then longest, non-overlapping: the documented semantics, done the slow way."""
    kept = [v for v in values if len(v) >= 4]
    out, i = [], 0
    while i < len(text):
        found = max((v for v in kept if text.startswith(v, i)), key=len, default=None)
        if found is None:
            out.append(text[i])
            i += 1
        else:
            out.append(REDACTED)
            i += len(found)
    return "".join(out)


@pytest.mark.parametrize(
    ("values", "text", "expected"),
    [
        (["sk-live-abc"], "key=sk-live-abc;", f"key={REDACTED};"),
        (["sk-live-abc"], "sk-live-abc sk-live-abc", f"{REDACTED} {REDACTED}"),
        (["abc"], "abc is too short to redact", "abc is too short to redact"),
        (["abcd"], "abcd", REDACTED),
        (["secret", "secret-long"], "x secret-long y", f"x {REDACTED} y"),
        (["secret-long", "secret"], "x secret-long y", f"x {REDACTED} y"),
        (["abcdef", "cdefgh"], "abcdefgh", f"{REDACTED}gh"),
        (["a.b*c+d", "(x|y)"], "a.b*c+d axbcd (x|y) x", f"{REDACTED} axbcd {REDACTED} x"),
        (["line\nbreak"], "a line\nbreak here", f"a {REDACTED} here"),
        (["ключ-секрет"], "the ключ-секрет!", f"the {REDACTED}!"),
        (["Secret"], "SECRET secret Secret", f"SECRET secret {REDACTED}"),  # case-sensitive
        ([], "nothing to do", "nothing to do"),
        (["", "   ", "ab"], "ab   ", "ab   "),
    ],
)
def test_redact_examples(values: list[str], text: str, expected: str) -> None:
    assert Redactor(values).redact(text) == expected


# Text and secrets avoid the marker's characters: a secret such as "ACTE" is inside "[REDACTED]"
# itself, which no redaction can help.
PLAIN = st.characters(exclude_characters="[]REDACT", max_codepoint=0x24F)
SMALL = st.sampled_from("abcxy -")


@settings(max_examples=500, deadline=None)
@given(data=st.data())
def test_no_secret_survives_redaction(data: st.DataObject) -> None:
    alphabet = data.draw(st.sampled_from([PLAIN, SMALL]), label="alphabet")
    values = data.draw(st.lists(st.text(alphabet, min_size=1, max_size=12), max_size=12), label="values")
    filler = st.text(alphabet, max_size=6)
    pieces = data.draw(st.lists(st.sampled_from(values) | filler if values else filler, max_size=12))
    text = "".join(pieces)
    redacted = Redactor(values).redact(text)
    for value in values:
        if len(value) >= 4:
            assert value not in redacted
    assert redacted == reference_redact(text, values)


@settings(max_examples=300, deadline=None)
@given(values=st.lists(st.text(SMALL, min_size=0, max_size=9), max_size=30), text=st.text(SMALL, max_size=60))
def test_redact_matches_the_reference_on_overlapping_secrets(values: list[str], text: str) -> None:
    assert Redactor(values).redact(text) == reference_redact(text, values)


def test_deeply_nested_secret_prefixes_compile_and_redact_longest() -> None:
    # Each secret extends the previous one: past the nesting limit the trie is emitted flat.
    values = ["a" * n for n in range(4, 400)]
    redactor = Redactor(values)
    assert redactor.redact("a" * 399) == REDACTED
    assert redactor.redact("a" * 400) == REDACTED + "a"
    assert redactor.redact("b" + "a" * 300 + "b") == f"b{REDACTED}b"
    assert redactor.redact("aaa") == "aaa"


def test_deep_chain_matches_the_reference() -> None:
    values = ["ab" * n for n in range(2, 150)] + ["ab" * n + "c" for n in range(2, 150, 7)]
    redactor = Redactor(values)
    for text in ["ab" * 150, "ab" * 77 + "c" + "ab" * 3, "x" + "ab" * 51 + "cab" * 2]:
        assert redactor.redact(text) == reference_redact(text, values)


def best_of(runs: int, run: Callable[[], object]) -> float:
    best = float("inf")
    for _ in range(runs):
        started = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - started)
    return best


def test_many_secrets_redact_in_time_independent_of_their_number() -> None:
    rng = random.Random(7)
    alphabet = string.ascii_letters + string.digits + "-_"
    values = ["".join(rng.choices(alphabet, k=32)) for _ in range(1000)]
    words = ["".join(rng.choices(alphabet, k=8)) for _ in range(6000)]
    words[::50] = values[: len(words[::50])]
    text = " ".join(words)
    redactor = Redactor(values)
    redacted = redactor.redact(text)
    assert redacted.count(REDACTED) == len(words[::50])
    assert not any(v in redacted for v in values)
    # The floor, measured in the same run: one flat alternation of the same literals, which
    # tries every secret at every position. The trie tries about one branch per character.
    flat = re.compile("|".join(re.escape(v) for v in sorted(values, key=len, reverse=True)))
    assert flat.sub(REDACTED, text) == redacted
    trie_time = best_of(3, lambda: redactor.redact(text))
    flat_time = best_of(2, lambda: flat.sub(REDACTED, text))
    assert trie_time * 5 < flat_time, (trie_time, flat_time)  # about 20x here


class Pair(NamedTuple):
    left: object
    right: object


def test_redact_obj_walks_dicts_lists_and_tuples_but_not_keys() -> None:
    redactor = Redactor(["sk-live-abc", "hunter22"])
    obj: dict[str, Any] = {
        "sk-live-abc": "the key is sk-live-abc",
        "nested": [{"password": "hunter22"}, ("hunter22", 5, None, 1.5, True), b"hunter22"],
        "pair": Pair("sk-live-abc", ["hunter22"]),
        "ordered": OrderedDict(a="hunter22"),
        "number": 7,
    }
    out = redactor.redact_obj(obj)
    assert out == {
        "sk-live-abc": f"the key is {REDACTED}",
        "nested": [{"password": REDACTED}, (REDACTED, 5, None, 1.5, True), b"hunter22"],
        "pair": Pair(REDACTED, [REDACTED]),
        "ordered": {"a": REDACTED},
        "number": 7,
    }
    assert isinstance(out["pair"], Pair)
    assert isinstance(out["nested"][1], tuple)
    assert obj["nested"][0] == {"password": "hunter22"}  # the input is left as it was


def test_an_empty_redactor_returns_its_input_unchanged() -> None:
    redactor = Redactor(["", "abc", "xy"])
    assert not redactor
    obj = {"a": ["abc"]}
    assert redactor.redact_obj(obj) is obj
    text = "abc xy"
    assert redactor.redact(text) is text
    assert Redactor(["abcd"])


def test_redactor_repr_shows_no_secret() -> None:
    assert "sk-live-abc" not in repr(Redactor(["sk-live-abc"]))


def test_redactor_takes_any_iterable_once() -> None:
    redactor = Redactor(v for v in ["sk-live-abc", "sk-live-abc"])
    assert redactor.redact("sk-live-abc") == REDACTED
