"""Roles (a connector's claim against the agent's ceiling and the operator's word), mute times, and
the CLI's durations and times: the rules, case by case."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from types import SimpleNamespace
from typing import Any

import pytest
from google.protobuf.timestamp_pb2 import Timestamp

from parley.v1 import runtime_pb2
from parley_cli.admin_commands import duration_seconds, until_timestamp
from parley_platform.errors import ParleyError
from parley_runtime.admin_api import mute_until
from parley_runtime.roles import capped_claim, ceiling, turn_role

NOW = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)


def agent(**settings: str) -> Any:
    return SimpleNamespace(setting=settings.get)


@pytest.mark.parametrize(
    ("settings", "claim", "expected"),
    [
        ({}, None, None),
        ({}, "OWNER", "MEMBER"),
        ({}, "ADMIN", "MEMBER"),
        ({}, "MEMBER", "MEMBER"),
        ({}, "GUEST", "GUEST"),
        ({}, "NONE", "NONE"),
        ({"CONNECTOR_ROLE_CEILING": "admin"}, "OWNER", "ADMIN"),
        ({"CONNECTOR_ROLE_CEILING": "ADMIN"}, "ADMIN", "ADMIN"),
        ({"CONNECTOR_ROLE_CEILING": "OWNER"}, "OWNER", "OWNER"),
        ({"CONNECTOR_ROLE_CEILING": "NONE"}, "MEMBER", "NONE"),
        ({"CONNECTOR_ROLE_CEILING": "ROOT"}, "OWNER", "MEMBER"),  # an unknown ceiling is the default
    ],
)
def test_a_claim_is_capped_at_the_agents_ceiling(
    settings: dict[str, str], claim: str | None, expected: str | None
) -> None:
    assert capped_claim(agent(**settings), claim) == expected


def test_the_default_ceiling_is_member() -> None:
    assert ceiling(agent()) == "MEMBER"


@pytest.mark.parametrize(
    ("stored", "source", "claim", "expected"),
    [
        (None, None, None, "MEMBER"),
        (None, None, "GUEST", "GUEST"),
        ("ADMIN", "connector", None, "ADMIN"),
        ("ADMIN", "connector", "MEMBER", "MEMBER"),
        ("ADMIN", "operator", "NONE", "ADMIN"),
        ("NONE", "operator", "MEMBER", "NONE"),
        ("OWNER", "operator", None, "OWNER"),
    ],
)
def test_the_operators_role_wins_over_any_claim(
    stored: str | None, source: str | None, claim: str | None, expected: str
) -> None:
    assert turn_role(stored, source, claim) == expected


def stamp(moment: datetime) -> Timestamp:
    value = Timestamp()
    value.FromDatetime(moment)
    return value


@pytest.mark.parametrize(
    ("request_", "expected"),
    [
        (runtime_pb2.SetMuteRequest(muted=True), None),
        (runtime_pb2.SetMuteRequest(muted=False), None),
        (runtime_pb2.SetMuteRequest(muted=True, duration_seconds=90), NOW + timedelta(seconds=90)),
        (
            runtime_pb2.SetMuteRequest(muted=True, until=stamp(NOW + timedelta(hours=2))),
            NOW + timedelta(hours=2),
        ),
    ],
)
def test_when_a_mute_ends(request_: runtime_pb2.SetMuteRequest, expected: datetime | None) -> None:
    assert mute_until(request_, NOW) == expected


@pytest.mark.parametrize(
    ("request_", "says"),
    [
        (
            runtime_pb2.SetMuteRequest(
                muted=True, duration_seconds=0.0001, until=stamp(NOW + timedelta(hours=1))
            ),
            "not both",
        ),
        (runtime_pb2.SetMuteRequest(muted=True, until=stamp(NOW - timedelta(seconds=1))), "future"),
        (runtime_pb2.SetMuteRequest(muted=True, until=stamp(NOW + timedelta(days=400))), "within a year"),
        (runtime_pb2.SetMuteRequest(muted=True, duration_seconds=-5), "above 0"),
        (runtime_pb2.SetMuteRequest(muted=True, duration_seconds=float("nan")), "above 0"),
        (runtime_pb2.SetMuteRequest(muted=True, duration_seconds=400 * 86400), "at most a year"),
        (runtime_pb2.SetMuteRequest(muted=False, duration_seconds=5), "unmute"),
    ],
)
def test_a_wrong_mute_time_says_what_is_wrong(request_: runtime_pb2.SetMuteRequest, says: str) -> None:
    with pytest.raises(ParleyError) as caught:
        mute_until(request_, NOW)
    assert caught.value.code == "MUTE_TIME_INVALID"
    assert says in caught.value.message


@pytest.mark.parametrize(
    ("text", "seconds"), [("90", 90), ("90s", 90), ("30m", 1800), ("2h", 7200), ("1.5d", 129600)]
)
def test_cli_durations(text: str, seconds: float) -> None:
    assert duration_seconds(text) == seconds


@pytest.mark.parametrize("text", ["soon", "", "5w", "-3m"])
def test_cli_refuses_other_durations(text: str) -> None:
    with pytest.raises(ParleyError):
        duration_seconds(text)


def test_cli_times_need_a_zone() -> None:
    assert until_timestamp("2026-12-24T18:00:00Z").ToDatetime(tzinfo=UTC) == datetime(
        2026, 12, 24, 18, tzinfo=UTC
    )
    with pytest.raises(ParleyError):
        until_timestamp("2026-12-24T18:00:00")
    with pytest.raises(ParleyError):
        until_timestamp("tomorrow")
