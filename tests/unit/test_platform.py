"""Pure parts of the platform library: errors, pages, backoff, settings."""

from __future__ import annotations

import grpc
import pytest
from pydantic import ValidationError

from parley.v1 import common_pb2
from parley_platform import errors
from parley_platform.paging import Page, cut, page_of
from parley_platform.retry import Backoff
from parley_platform.settings import Settings


@pytest.mark.parametrize(
    ("error", "status"),
    [
        (errors.InvalidArgument, grpc.StatusCode.INVALID_ARGUMENT),
        (errors.NotFound, grpc.StatusCode.NOT_FOUND),
        (errors.Conflict, grpc.StatusCode.ABORTED),
        (errors.FailedPrecondition, grpc.StatusCode.FAILED_PRECONDITION),
        (errors.ResourceExhausted, grpc.StatusCode.RESOURCE_EXHAUSTED),
        (errors.Unauthenticated, grpc.StatusCode.UNAUTHENTICATED),
        (errors.Unavailable, grpc.StatusCode.UNAVAILABLE),
        (errors.DeadlineExceeded, grpc.StatusCode.DEADLINE_EXCEEDED),
        (errors.Internal, grpc.StatusCode.INTERNAL),
    ],
)
def test_each_kind_maps_to_one_grpc_status_and_round_trips(
    error: type[errors.ParleyError], status: grpc.StatusCode
) -> None:
    raised = error("what went wrong", code="SOME_CODE", hint="do this")
    assert raised.grpc_status == status
    back = errors.ParleyError.from_proto(common_pb2.Error.FromString(raised.to_proto().SerializeToString()))
    assert type(back) is error
    assert (back.code, back.message, back.hint, back.retryable) == (
        "SOME_CODE",
        "what went wrong",
        "do this",
        raised.retryable,
    )


def test_retryable_is_a_property_of_the_type_unless_overridden() -> None:
    assert errors.Unavailable("x").retryable
    assert not errors.InvalidArgument("x").retryable
    assert errors.Conflict("x", retryable=True).retryable
    assert not errors.Conflict("x").retryable


@pytest.mark.parametrize(
    ("limit", "offset", "expected"),
    [(0, 0, Page(50, 0)), (1, 0, Page(1, 0)), (100, 7, Page(100, 7))],
)
def test_valid_pages(limit: int, offset: int, expected: Page) -> None:
    assert page_of(common_pb2.PageRequest(limit=limit, offset=offset)) == expected


@pytest.mark.parametrize(
    ("limit", "offset", "field"), [(101, 0, "limit"), (-1, 0, "limit"), (10, -1, "offset")]
)
def test_invalid_pages(limit: int, offset: int, field: str) -> None:
    with pytest.raises(errors.InvalidArgument, match=f"page.{field}"):
        page_of(common_pb2.PageRequest(limit=limit, offset=offset))


def test_cut_reports_the_next_page_only_when_there_is_one() -> None:
    page = Page(2, 4)
    items, response = cut(page, ["a", "b", "c"])
    assert items == ["a", "b"]
    assert response.has_more
    assert response.next_offset == 6
    items, response = cut(page, ["a", "b"])
    assert items == ["a", "b"]
    assert not response.has_more
    assert not response.HasField("next_offset")


def test_backoff_grows_and_is_capped() -> None:
    delays = [Backoff(base=0.5, cap=30).delay(n) for n in range(1, 10)]
    assert delays[:4] == [0.5, 1.0, 2.0, 4.0]
    assert delays[-1] == 30
    assert delays == sorted(delays)


def test_settings_come_from_parley_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PARLEY_NAMESPACE", "abc")
    monkeypatch.setenv("PARLEY_OPERATOR_TOKEN", "sekret")
    settings = Settings()
    assert settings.namespace == "abc"
    assert settings.operator_token is not None
    assert "sekret" not in repr(settings)


@pytest.mark.parametrize("namespace", ["", "Has-Upper", "a.b", "x" * 40])
def test_invalid_namespaces_are_refused(monkeypatch: pytest.MonkeyPatch, namespace: str) -> None:
    monkeypatch.setenv("PARLEY_NAMESPACE", namespace)
    with pytest.raises(ValidationError):
        Settings()
