"""Pure parts of pairing: codes, validation, pages, the wire-type check, the DM gate's texts, CLI parsing."""

from __future__ import annotations

import ast
import collections
import math
import struct
import uuid
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path
from zoneinfo import ZoneInfo

import pytest
from google.protobuf.timestamp_pb2 import Timestamp

from parley.v1 import pairing_pb2
from parley_cli import main as cli_main
from parley_clients.pairing import DmPolicy, dm_policy, pairing_reply
from parley_devinfra.infra import free_port
from parley_pairing import domain
from parley_pairing.api import well_formed
from parley_platform.convert import timestamp
from parley_platform.errors import InvalidArgument
from parley_platform.paging import Page, cut, page_bounds

DOMAIN_SOURCE = Path(domain.__file__)


def test_codes_are_eight_characters_of_the_alphabet() -> None:
    codes = {domain.new_code() for _ in range(2000)}
    assert len(codes) == 2000, "8 characters of 32 should not repeat in 2000 draws"
    for code in codes:
        assert len(code) == 8
        assert set(code) <= set(domain.ALPHABET)
    # The spec's alphabet, verbatim. Its note says "no 0/O/1/I/L", yet the alphabet has an L
    # (it is what makes 32 characters); the alphabet is what codes are checked against.
    assert domain.ALPHABET == "ABCDEFGHJKLMNPQRSTUVWXYZ23456789"
    assert not set("0O1I") & set(domain.ALPHABET)
    assert len(domain.ALPHABET) == len(set(domain.ALPHABET)) == 32


def test_codes_are_uniform_over_the_alphabet() -> None:
    counts = collections.Counter("".join(domain.new_code() for _ in range(4000)))
    expected = 4000 * 8 / 32
    chi_square = sum((counts[c] - expected) ** 2 / expected for c in domain.ALPHABET)
    # 31 degrees of freedom: a uniform source exceeds 85 with p < 1e-7.
    assert chi_square < 85, counts


def test_rejection_sampling_keeps_an_uneven_alphabet_uniform() -> None:
    # 256 % 3 == 1: without rejection, 'a' (byte 255 → 255 % 3 == 0) would be favoured.
    counts = collections.Counter("".join(domain.new_code(30, "abc") for _ in range(2000)))
    expected = 60000 / 3
    assert all(abs(counts[c] - expected) < 5 * math.sqrt(expected) for c in "abc"), counts
    with pytest.raises(ValueError, match="alphabet"):
        domain.new_code(8, "a")


def test_codes_come_from_secrets_never_random() -> None:
    tree = ast.parse(DOMAIN_SOURCE.read_text())
    imported = {
        alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names
    } | {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
    assert "secrets" in imported
    assert "random" not in imported


@pytest.mark.parametrize(
    ("typed", "code"),
    [
        ("ABCD2345", "ABCD2345"),
        ("abcd2345", "ABCD2345"),
        ("  abcd 2345\n", "ABCD2345"),
        ("ab cd 23 45", "ABCD2345"),
        ("\tAbCd2345 ", "ABCD2345"),
    ],
)
def test_a_typed_code_is_trimmed_and_upper_cased(typed: str, code: str) -> None:
    assert domain.normalize_code(typed) == code


@pytest.mark.parametrize(
    "typed", ["ABCD234", "ABCD23456", "ABCD-2345", "ABCD2340", "OBCD2345", "ABCD1345", "ÄBCD2345"]
)
def test_a_malformed_code_is_invalid_and_not_echoed(typed: str) -> None:
    with pytest.raises(InvalidArgument) as caught:
        domain.normalize_code(typed)
    assert caught.value.code == "INVALID_CODE"
    assert typed not in str(caught.value)
    assert "code must be 8 characters" in caught.value.message


def test_an_empty_code_is_required() -> None:
    with pytest.raises(InvalidArgument) as caught:
        domain.normalize_code("   ")
    assert caught.value.code == "CODE_REQUIRED"


@pytest.mark.parametrize(
    ("limit", "offset", "expected"),
    [
        (None, None, (50, 0)),
        (1, 0, (1, 0)),
        (100, 7, (100, 7)),
        ("25", "10", (25, 10)),
        (" 3 ", "+4", (3, 4)),
        (50, 10**12, (50, 10**12)),
    ],
)
def test_page_bounds_accept_integers(limit: object, offset: object, expected: tuple[int, int]) -> None:
    assert page_bounds(limit, offset) == expected


@pytest.mark.parametrize(
    ("limit", "offset", "field", "shown"),
    [
        (0, None, "limit", "got 0"),
        (101, None, "limit", "got 101"),
        (-1, None, "limit", "got -1"),
        (1.5, None, "limit", "got 1.5"),
        ("1.5", None, "limit", "got '1.5'"),
        (2.0, None, "limit", "got 2.0"),
        ("ten", None, "limit", "got 'ten'"),
        ("", None, "limit", "got ''"),
        (True, None, "limit", "boolean"),
        ([5], None, "limit", "got list"),
        (10**30, None, "limit", "got 1000000000000000000000000000000"),
        (None, -1, "offset", "got -1"),
        (None, 1.5, "offset", "got 1.5"),
        (None, "-1", "offset", "got -1"),
        (None, "1e3", "offset", "got '1e3'"),
        (None, False, "offset", "boolean"),
        (None, str(2**63), "offset", f"at most {2**63 - 1}"),
    ],
)
def test_page_bounds_refuse_everything_else_naming_the_field(
    limit: object, offset: object, field: str, shown: str
) -> None:
    with pytest.raises(InvalidArgument) as caught:
        page_bounds(limit, offset)
    assert caught.value.code == "INVALID_PAGE"
    assert caught.value.message.startswith(f"{field} must be")
    assert shown in caught.value.message


def test_cut_reports_the_next_page_only_when_there_is_one() -> None:
    page = Page(*page_bounds(3, 6))
    assert page.fetch == 4
    items, more = cut(page, [1, 2, 3, 4])
    assert (items, more.has_more, more.next_offset) == ([1, 2, 3], True, 9)
    items, last = cut(page, [1, 2, 3])
    assert (items, last.has_more, last.HasField("next_offset")) == ([1, 2, 3], False, False)
    items, empty = cut(page, [])
    assert (items, empty.has_more, empty.HasField("next_offset"), empty.offset, empty.limit) == (
        [],
        False,
        False,
        6,
        3,
    )


@pytest.mark.parametrize(
    ("call", "code"),
    [
        (lambda: domain.agent_uuid(""), "AGENT_REQUIRED"),
        (lambda: domain.agent_uuid("default"), "INVALID_AGENT_ID"),
        (lambda: domain.channel_name(""), "CHANNEL_REQUIRED"),
        (lambda: domain.channel_name("-discord"), "INVALID_CHANNEL"),
        (lambda: domain.channel_name("dis cord"), "INVALID_CHANNEL"),
        (lambda: domain.channel_name("d" * 65), "INVALID_CHANNEL"),
        (lambda: domain.text_id("", "sender_id"), "INVALID_ID"),
        (lambda: domain.text_id("   ", "sender_id"), "INVALID_ID"),
        (lambda: domain.text_id("a\x00b", "sender_id"), "INVALID_ID"),
        (lambda: domain.text_id("x" * 257, "sender_id"), "INVALID_ID"),
        (lambda: domain.metadata({str(i): "v" for i in range(33)}), "INVALID_METADATA"),
        (lambda: domain.metadata({"": "v"}), "INVALID_METADATA"),
        (lambda: domain.metadata({"name": "nul\x00"}), "INVALID_METADATA"),
        (lambda: domain.metadata({"name": "v" * 1025}), "INVALID_METADATA"),
    ],
)
def test_identifiers_and_metadata_are_validated(call: object, code: str) -> None:
    with pytest.raises(InvalidArgument) as caught:
        call()  # type: ignore[operator]
    assert caught.value.code == code


def test_valid_identifiers_pass_through() -> None:
    agent = uuid.uuid4()
    assert domain.agent_uuid(str(agent)) == agent
    assert domain.channel_name("discord") == "discord"
    assert domain.channel_name("slack.eu-1:dm") == "slack.eu-1:dm"
    assert domain.text_id("user#1234 ✓", "sender_id") == "user#1234 ✓"
    assert domain.actor("", "added_by") == "operator"
    assert domain.actor("alice", "added_by") == "alice"
    assert domain.metadata({"name": "Ann"}) == {"name": "Ann"}


def test_a_limit_sent_as_a_double_is_refused_not_defaulted() -> None:
    """A client may encode field 3 as the double 1.5; protobuf would drop it and leave limit unset."""
    good = pairing_pb2.ListPendingRequestsPageRequest(agent_id=str(uuid.uuid4()), channel="discord")
    as_double = good.SerializeToString() + bytes([3 << 3 | 1]) + struct.pack("<d", 1.5)
    decoded = pairing_pb2.ListPendingRequestsPageRequest.FromString(as_double)
    assert not decoded.HasField("limit")
    with pytest.raises(InvalidArgument) as caught:
        well_formed(decoded)
    assert caught.value.code == "INVALID_PAGE"
    assert caught.value.message == "limit must be an integer from 1 to 100, got a non-integer"

    offset_as_fixed32 = good.SerializeToString() + bytes([4 << 3 | 5]) + struct.pack("<f", 2.5)
    with pytest.raises(InvalidArgument, match="offset must be an integer of 0 or more"):
        well_formed(pairing_pb2.ListPendingRequestsPageRequest.FromString(offset_as_fixed32))


def test_a_string_field_sent_as_a_number_is_refused_and_unknown_fields_are_not() -> None:
    sender_as_varint = bytes([3 << 3 | 0, 7])
    with pytest.raises(InvalidArgument) as caught:
        well_formed(pairing_pb2.IsAllowedRequest.FromString(sender_as_varint))
    assert caught.value.code == "INVALID_FIELD"
    assert "sender_id" in caught.value.message
    newer_client = pairing_pb2.IsAllowedRequest(sender_id="a").SerializeToString() + bytes(
        [0xF8, 0x06, 1]
    )  # field 111, varint
    well_formed(pairing_pb2.IsAllowedRequest.FromString(newer_client))
    well_formed(pairing_pb2.IsAllowedRequest(sender_id="a"))


def test_dm_policies_parse_and_name_the_field() -> None:
    assert dm_policy("pairing") is DmPolicy.PAIRING
    assert dm_policy(" Allowlist ") is DmPolicy.ALLOWLIST
    assert {p.value for p in DmPolicy} == {"open", "pairing", "allowlist", "closed"}
    for bad in ("", "friends", None, 3):
        with pytest.raises(InvalidArgument) as caught:
            dm_policy(bad, "settings.dm_policy.discord")
        assert caught.value.message.startswith("settings.dm_policy.discord must be one of open, pairing")


def test_the_pairing_reply_gives_the_operator_command() -> None:
    assert "parley pairing approve discord ABCD2345" in pairing_reply("discord", "ABCD2345")
    assert pairing_reply("discord", "ABCD2345", "default").endswith("parley pairing approve discord ABCD2345")
    assert pairing_reply("discord", "ABCD2345", "helper").endswith(
        "parley pairing approve discord ABCD2345 --agent helper"
    )


@pytest.mark.parametrize(
    ("argv", "mentions"),
    [
        (["list", "discord", "--limit", "1.5"], "limit must be an integer from 1 to 100, got '1.5'"),
        (["list", "discord", "--limit", "0"], "limit must be an integer from 1 to 100, got 0"),
        (["list", "discord", "--limit", "101"], "limit must be an integer from 1 to 100, got 101"),
        (["allowlist", "discord", "--offset", "-1"], "offset must be an integer of 0 or more, got -1"),
        (["allowlist", "discord", "--offset=2.5"], "offset must be an integer of 0 or more, got '2.5'"),
    ],
)
def test_cli_page_arguments_are_checked_before_any_call(
    argv: list[str], mentions: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Nothing listens at these addresses: an error about them would mean a call was made first.
    monkeypatch.setenv("PARLEY_PAIRING_ADDR", f"127.0.0.1:{free_port()}")
    monkeypatch.setenv("PARLEY_RUNTIME_ADDR", f"127.0.0.1:{free_port()}")
    monkeypatch.setenv("PARLEY_OPERATOR_TOKEN", "unit-test-token")
    assert cli_main.main(["pairing", *argv]) == 1
    err = capsys.readouterr().err
    assert mentions in err
    assert "not reachable" not in err


def test_cli_parses_every_pairing_command() -> None:
    args = cli_main.parse_args(["pairing", "approve", "discord", "abcd", "2345", "--agent", "helper"])
    assert (args.channel, args.code, args.agent, args.by) == ("discord", ["abcd", "2345"], "helper", "")
    args = cli_main.parse_args(["pairing", "deny", "telegram", "ABCD2345"])
    assert (args.channel, args.code, args.agent) == ("telegram", ["ABCD2345"], "default")
    args = cli_main.parse_args(["pairing", "allow", "discord", "user-1", "--by", "ops"])
    assert (args.sender, args.by) == ("user-1", "ops")
    args = cli_main.parse_args(["pairing", "revoke", "discord", "user-1"])
    assert args.sender == "user-1"
    args = cli_main.parse_args(["pairing", "list", "discord", "--json"])
    assert (args.limit, args.offset, args.json) == (None, None, True)
    with pytest.raises(SystemExit):
        cli_main.parse_args(["pairing", "approve", "discord"])


@pytest.mark.parametrize(
    "when",
    [
        datetime(2026, 11, 29, 21, 2, 50, 102085, tzinfo=ZoneInfo("Etc/UTC")),
        datetime(2026, 1, 1, 0, 0, 0, 999999, tzinfo=timezone(timedelta(hours=5))),
        datetime(2099, 12, 31, 23, 59, 59, 1, tzinfo=UTC),
        datetime(1969, 12, 31, 23, 59, 59, 999999, tzinfo=UTC),
    ],
)
def test_timestamps_convert_exactly(when: datetime) -> None:
    expected = Timestamp()
    expected.FromDatetime(when)
    assert timestamp(when) == expected
