"""The reading of metric names and PromQL that the deployment checks rely on (tests/metric_names.py):
it finds what the services register, and it reports what they do not."""

from __future__ import annotations

import collections

from metric_names import (
    defined_metrics,
    metrics_classes,
    promql_grouping_labels,
    promql_matchers,
    promql_metric_names,
    promql_problems,
    promql_selectors,
    registered_families,
    series_index,
)


def test_promql_helpers_read_the_expressions_they_are_given() -> None:
    expr = 'histogram_quantile(0.99, sum by (le) (rate(x_seconds_bucket{a="b",c!~"d"}[5m] offset 1m))) > 5'
    assert promql_metric_names(expr) == {"x_seconds_bucket"}
    assert promql_matchers(expr) == [("a", "=", "b"), ("c", "!~", "d")]
    assert promql_selectors(expr) == [("x_seconds_bucket", [("a", "=", "b"), ("c", "!~", "d")])]
    assert promql_metric_names('absent(up{job="x"}) or absent(y_total) unless on (job) z') == {
        "up",
        "y_total",
        "z",
    }
    grafana = 'sum by (stage, le) (rate(t_bucket[$__rate_interval])) / ignoring (le) max(u{k=~"a|b"})'
    assert promql_metric_names(grafana) == {"t_bucket", "u"}
    assert promql_grouping_labels(grafana) == {"stage", "le"}


def test_the_reading_finds_every_metric_the_services_register() -> None:
    """Each metrics class, instantiated with a fresh registry, registers exactly what the reading of
    its source found: a metric named by a variable, or declared where the reading does not look,
    fails here instead of making a dashboard panel look unknown."""
    metrics = defined_metrics()
    classes = metrics_classes()
    assert len(classes) >= 7, classes  # messaging, worker, and one per service
    read: dict[tuple[str, str], set[tuple[str, str]]] = collections.defaultdict(set)
    for metric in metrics:
        assert metric.owner, f"{metric.name} is declared outside a metrics class ({metric.module})"
        read[(metric.module, metric.owner)].add((metric.family, metric.kind))
    assert set(read) <= set(classes), (
        f"metrics declared outside a registry-taking class: {set(read) - set(classes)}"
    )
    for module, owner in classes:
        assert registered_families(module, owner) == read[(module, owner)], f"{module}.{owner}"


def test_series_names_follow_prometheus_client() -> None:
    index = series_index(defined_metrics())
    # Declared as "parley_authz_decisions"; prometheus_client exports the counter with `_total`.
    assert "parley_authz_decisions_total" in index
    assert "parley_authz_decisions" not in index
    assert "parley_turn_stage_duration_seconds_bucket" in index
    assert "parley_turn_stage_duration_seconds" not in index
    assert "parley_tasks_due" in index


def test_promql_problems_name_what_no_service_exports() -> None:
    index = series_index(defined_metrics())
    source = '"replied" "error"'
    jobs = {"runtime"}
    good = (
        'sum by (outcome) (rate(parley_turns_total{outcome="replied", job="runtime"}[5m]))'
        " + histogram_quantile(0.9, sum by (le, stage) (rate(parley_turn_stage_duration_seconds_bucket[5m])))"
    )
    assert promql_problems(good, index, jobs, source) == []
    cases = {
        "sum(rate(parley_turn_total[5m]))": "no metric parley_turn_total",
        'sum(rate(parley_turns_total{stage="x"}[5m]))': "parley_turns_total has no label stage",
        'sum(rate(parley_turns_total{outcome="replyed"}[5m]))': "outcome='replyed' is never set",
        "sum by (provider) (rate(parley_turns_total[5m]))": "groups by provider",
        'up{job="gateway"}': "no scrape job gateway",
        "vector(1)": "selects no metric",
    }
    for expr, expected in cases.items():
        problems = promql_problems(expr, index, jobs, source)
        assert any(expected in problem for problem in problems), (expr, problems)
