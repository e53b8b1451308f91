"""The Grafana dashboard (deploy/grafana/dashboards/) and its provisioning by docker-compose.yml.

Every query on the dashboard names only metrics, labels and label values the services' code
defines (tests/metric_names.py reads them from the code), parses as PromQL (promtool), and reads
from the datasource Grafana is provisioned with, which is the compose Prometheus.
"""

from __future__ import annotations

import json
import re
from pathlib import Path, PurePosixPath
from typing import Any

import pytest
import yaml
from metric_names import (
    ROOT,
    Metric,
    defined_metrics,
    promql_grouping_labels,
    promql_metric_names,
    promql_problems,
    run_promtool,
    series_index,
)

GRAFANA = ROOT / "deploy" / "grafana"
DASHBOARDS = GRAFANA / "dashboards"
PROVISIONING = GRAFANA / "provisioning"
COMPOSE = ROOT / "docker-compose.yml"
PROMETHEUS = ROOT / "deploy" / "prometheus.yml"
# Grafana's own variables, replaced by a duration before promtool reads a query.
GRAFANA_RANGES = re.compile(r"\$__(?:rate_interval|interval|range)\b")
GRID_COLUMNS = 24
# What the dashboard must show (issue 15): at least one panel selects each of these.
REQUIRED_SERIES = {
    "parley_turns_total": "turns by outcome",
    "parley_turn_stage_duration_seconds_bucket": "latency by stage",
    "parley_messages_inflight": "consumer backlog (no lag metric exists: in flight and rates)",
    "parley_received_messages_total": "consumer backlog",
    "parley_dead_letters_total": "dead letters by reason",
    "parley_inbound_dead_total": "inbound dead letters by reason",
    "parley_model_requests_total": "model calls",
    "parley_model_tokens_total": "model tokens",
    "parley_authz_pending": "pending approvals",
    "parley_authz_pending_age_seconds": "age of pending approvals",
    "parley_task_lag_seconds_bucket": "scheduler lag",
    "up": "service health",
    "parley_providers_failed_total": "dependency health",
}


def load_yaml(path: Path) -> Any:
    assert path.is_file(), f"{path.relative_to(ROOT)} is missing"
    return yaml.safe_load(path.read_text())


@pytest.fixture(scope="module")
def dashboards() -> dict[str, dict[str, Any]]:
    files = sorted(DASHBOARDS.glob("*.json"))
    assert files, f"no dashboard in {DASHBOARDS.relative_to(ROOT)}"
    return {path.name: json.loads(path.read_text()) for path in files}


@pytest.fixture(scope="module")
def datasource() -> dict[str, Any]:
    sources = [
        source
        for path in sorted((PROVISIONING / "datasources").glob("*.y*ml"))
        for source in load_yaml(path).get("datasources") or []
    ]
    assert len(sources) == 1, sources
    return dict(sources[0])


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    doc = load_yaml(COMPOSE)
    assert isinstance(doc, dict)
    return doc


def panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    """Every panel, those inside collapsed rows too."""
    found = []
    for panel in dashboard.get("panels") or []:
        found.append(panel)
        found += panel.get("panels") or []
    return found


def queries(dashboard: dict[str, Any]) -> list[tuple[str, str]]:
    """(panel title, expression) of every query."""
    return [
        (str(panel.get("title")), str(target["expr"]))
        for panel in panels(dashboard)
        for target in panel.get("targets") or []
        if target.get("expr")
    ]


def test_panels_have_unique_ids_and_fit_the_grid_without_overlapping(
    dashboards: dict[str, dict[str, Any]],
) -> None:
    for name, dashboard in dashboards.items():
        assert dashboard.get("uid"), name
        assert dashboard.get("title"), name
        ids = [panel.get("id") for panel in panels(dashboard)]
        assert None not in ids, f"{name}: a panel without an id"
        assert len(ids) == len(set(ids)), f"{name}: panel ids {ids}"
        taken: dict[tuple[int, int], str] = {}
        for panel in panels(dashboard):
            grid = panel["gridPos"]
            assert 0 <= grid["x"] < grid["x"] + grid["w"] <= GRID_COLUMNS, panel["title"]
            for x in range(grid["x"], grid["x"] + grid["w"]):
                for y in range(grid["y"], grid["y"] + grid["h"]):
                    assert (x, y) not in taken, f"{name}: {panel['title']!r} overlaps {taken[(x, y)]!r}"
                    taken[(x, y)] = panel["title"]


def test_every_panel_queries_the_provisioned_prometheus(
    dashboards: dict[str, dict[str, Any]], datasource: dict[str, Any]
) -> None:
    assert datasource["type"] == "prometheus"
    for name, dashboard in dashboards.items():
        for panel in panels(dashboard):
            if panel.get("type") == "row":
                continue
            targets = panel.get("targets") or []
            assert targets, f"{name}: {panel['title']!r} queries nothing"
            assert all(t.get("expr") for t in targets), f"{name}: {panel['title']!r} has an empty query"
            for ref in [panel.get("datasource"), *(t.get("datasource") for t in targets)]:
                assert ref == {"type": "prometheus", "uid": datasource["uid"]}, (name, panel["title"], ref)
            ref_ids = [t.get("refId") for t in targets]
            assert len(set(ref_ids)) == len(ref_ids), (name, panel["title"], ref_ids)


def test_every_query_names_only_metrics_labels_and_values_the_services_define(
    dashboards: dict[str, dict[str, Any]],
) -> None:
    index: dict[str, list[Metric]] = series_index(defined_metrics())
    jobs = {job["job_name"] for job in load_yaml(PROMETHEUS)["scrape_configs"]}
    source_text = "\n".join(
        path.read_text() for root in (ROOT / "libs", ROOT / "services") for path in root.rglob("*.py")
    )
    problems = [
        f"{name}: {title!r}: {problem} in {expr!r}"
        for name, dashboard in dashboards.items()
        for title, expr in queries(dashboard)
        for problem in promql_problems(expr, index, jobs, source_text)
    ]
    assert not problems, "\n".join(problems)


def test_the_dashboard_shows_what_operators_need(dashboards: dict[str, dict[str, Any]]) -> None:
    used = {metric for dashboard in dashboards.values() for _, expr in queries(dashboard)
            for metric in promql_metric_names(expr)}  # fmt: skip
    missing = {series: why for series, why in REQUIRED_SERIES.items() if series not in used}
    assert not missing, f"no panel shows {missing}"
    by_stage = [
        expr
        for dashboard in dashboards.values()
        for _, expr in queries(dashboard)
        if "parley_turn_stage_duration_seconds_bucket" in expr
    ]
    assert any("stage" in promql_grouping_labels(expr) for expr in by_stage), (
        "stage latency is not split by stage"
    )


def test_every_query_parses_as_promql(dashboards: dict[str, dict[str, Any]], tmp_path: Path) -> None:
    """promtool checks the queries as recording rules (Grafana's range variables replaced)."""
    rules = [
        {"record": f"dashboard:query_{i}", "expr": GRAFANA_RANGES.sub("5m", expr)}
        for i, (_, expr) in enumerate(q for dashboard in dashboards.values() for q in queries(dashboard))
    ]
    assert rules
    path = tmp_path / "dashboard-queries.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    result = run_promtool("check", "rules", str(path))
    assert result.returncode == 0, f"promtool: {result.stdout}{result.stderr}"


def mounts(service: dict[str, Any]) -> dict[str, Path]:
    """Container path → host path of a service's bind mounts."""
    found = {}
    for volume in service.get("volumes") or []:
        source, target = str(volume).split(":")[:2]
        if source.startswith("."):
            found[target] = (ROOT / source).resolve()
    return found


def test_compose_provisions_grafana_with_the_compose_prometheus_and_the_dashboards(
    compose: dict[str, Any], datasource: dict[str, Any]
) -> None:
    services = compose["services"]
    grafana = services.get("grafana")
    assert grafana, "docker-compose.yml has no grafana service"
    mounted = mounts(grafana)
    assert mounted.get("/etc/grafana/provisioning") == PROVISIONING.resolve(), mounted
    providers = [
        provider
        for path in sorted((PROVISIONING / "dashboards").glob("*.y*ml"))
        for provider in load_yaml(path).get("providers") or []
    ]
    assert providers, "no dashboard provider"
    for provider in providers:
        path = str(PurePosixPath(provider["options"]["path"]))
        assert mounted.get(path) == DASHBOARDS.resolve(), f"provider reads {path}, compose mounts {mounted}"
    # The datasource is the compose Prometheus, on the port it listens on inside the network.
    match = re.fullmatch(r"http://([\w.-]+):(\d+)/?", str(datasource["url"]))
    assert match, datasource["url"]
    host, port = match.groups()
    assert host in services, f"datasource host {host} is not a compose service"
    prometheus = services[host]
    assert "prometheus" in str(prometheus.get("image")), prometheus.get("image")
    assert any(f":{port}/" in arg for arg in prometheus["healthcheck"]["test"]), (
        "Prometheus listens elsewhere"
    )
    assert grafana["depends_on"][host]["condition"] == "service_healthy"
    # The admin password is required, never a default written in the file.
    password = str(grafana["environment"]["GF_SECURITY_ADMIN_PASSWORD"])
    assert re.fullmatch(r"\$\{\w+:\?[^}]*\}", password), "GF_SECURITY_ADMIN_PASSWORD must be required"
