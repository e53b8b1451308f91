"""The metrics the services' code defines, and the PromQL that deploy/ may write about them.

Dashboards and alert rules are only as good as the names in their queries: a query about a metric
no service exports draws an empty panel or never fires, and nothing complains. The names are
collected from the code (every ``Counter``/``Gauge``/``Histogram``/``Summary`` call, and the
platform's ``LoopCounter``/``LoopGauge``/``LoopHistogram``/``GaugeFunctions``, whose name is a literal, read
with ``ast``), and each metrics class found there is also instantiated with a fresh
``CollectorRegistry`` so that a metric the reading missed is noticed (tests/unit/test_deploy.py).
"""

from __future__ import annotations

import ast
import importlib
import re
import shutil
import subprocess
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
METRIC_SOURCES = (ROOT / "libs", ROOT / "services")
METRIC_TYPES = {
    "Counter": "counter",
    "Gauge": "gauge",
    "Histogram": "histogram",
    "Summary": "summary",
    # parley_platform.metrics: the event loop's own counters, gauges and histograms, gauges read when
    # scraped.
    "LoopCounter": "counter",
    "LoopGauge": "gauge",
    "LoopHistogram": "histogram",
    "GaugeFunctions": "gauge",
}
# Made by Prometheus for every target, not by the services.
BUILTIN_METRICS = {"up", "scrape_duration_seconds", "scrape_samples_scraped"}
TARGET_LABELS = {"job", "instance"}

PROMQL_KEYWORDS = {
    "and", "or", "unless", "by", "without", "on", "ignoring", "group_left", "group_right", "offset",
    "bool", "sum", "min", "max", "avg", "count", "stddev", "stdvar", "topk", "bottomk", "quantile",
    "count_values", "group", "limitk", "limit_ratio", "inf", "nan",
}  # fmt: skip


@dataclass(frozen=True)
class Metric:
    name: str  # as declared (a counter's ``_total`` is optional there)
    kind: str  # counter, gauge, histogram, summary
    labels: tuple[str, ...]
    module: str
    owner: str  # the class that declares it, "" at module level

    @property
    def family(self) -> str:
        """The name prometheus_client registers: a counter's without ``_total``."""
        return self.name.removesuffix("_total") if self.kind == "counter" else self.name

    def series_names(self) -> set[str]:
        """The names a query can select."""
        if self.kind == "counter":
            return {f"{self.family}_total", f"{self.family}_created"}
        if self.kind == "histogram":
            return {f"{self.name}_{suffix}" for suffix in ("bucket", "sum", "count", "created")}
        if self.kind == "summary":
            return {self.name, *(f"{self.name}_{suffix}" for suffix in ("sum", "count", "created"))}
        return {self.name}

    def labels_of(self, series: str) -> set[str]:
        return set(self.labels) | ({"le"} if series.endswith("_bucket") else set())


def module_name(path: Path) -> str:
    """``services/runtime/parley_runtime/turn/state.py`` → ``parley_runtime.turn.state``."""
    parts = [path.stem]
    folder = path.parent
    while (folder / "__init__.py").is_file():
        parts.insert(0, folder.name)
        folder = folder.parent
    return ".".join(parts)


def _literal_strings(node: ast.expr | None, what: str) -> tuple[str, ...]:
    if node is None:
        return ()
    if isinstance(node, (ast.List, ast.Tuple)) and all(
        isinstance(e, ast.Constant) and isinstance(e.value, str) for e in node.elts
    ):
        return tuple(str(e.value) for e in node.elts)  # type: ignore[attr-defined]
    raise ValueError(f"{what}: label names must be a literal list for the deployment checks to read them")


def metrics_in(path: Path) -> list[Metric]:
    """Every metric a file declares with a literal name."""
    tree = ast.parse(path.read_text(), str(path))
    owners = {
        id(node): cls.name
        for cls in ast.walk(tree)
        if isinstance(cls, ast.ClassDef)
        for node in ast.walk(cls)
    }
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        kind_name = (
            func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
        )
        # A metric has a name and a documentation string; collections.Counter takes one argument.
        if kind_name not in METRIC_TYPES or len(node.args) < 2:
            continue
        first = node.args[0]
        if not (isinstance(first, ast.Constant) and isinstance(first.value, str)):
            continue
        keywords = {k.arg: k.value for k in node.keywords}
        labels_node = node.args[2] if len(node.args) > 2 else keywords.get("labelnames")
        where = f"{path.relative_to(ROOT)}:{node.lineno}"
        found.append(
            Metric(
                name=first.value,
                kind=METRIC_TYPES[kind_name],
                labels=_literal_strings(labels_node, where),
                module=module_name(path),
                owner=owners.get(id(node), ""),
            )
        )
    return found


def defined_metrics(sources: Iterable[Path] = METRIC_SOURCES) -> list[Metric]:
    files = [path for root in sources for path in sorted(root.rglob("*.py")) if "_pb2" not in path.name]
    return [metric for path in files for metric in metrics_in(path)]


def series_index(metrics: Iterable[Metric]) -> dict[str, list[Metric]]:
    """Selectable series name → the metrics that export it (one name may be declared by several
    services, e.g. two services with a ``parley_..._inflight`` gauge of their own)."""
    index: dict[str, list[Metric]] = {}
    for metric in metrics:
        for series in metric.series_names():
            index.setdefault(series, []).append(metric)
    return index


def registered_families(module: str, owner: str) -> set[tuple[str, str]]:
    """(family name, type) of what ``owner(CollectorRegistry())`` registers."""
    from prometheus_client import CollectorRegistry

    registry = CollectorRegistry()
    getattr(importlib.import_module(module), owner)(registry)
    return {(family.name, family.type) for family in registry.collect()}


# --- PromQL ----------------------------------------------------------------------------------------


def _blank_strings(expr: str) -> str:
    return re.sub(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'', '""', expr)


def promql_metric_names(expr: str) -> set[str]:
    """Metric names an expression selects (not functions, keywords, labels or durations)."""
    text = _blank_strings(expr)
    text = re.sub(r"\{[^}]*\}", " ", text)
    text = re.sub(r"\[[^\]]*\]", " ", text)
    text = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text)
    names = set()
    for match in re.finditer(r"(?<![\w.$])[A-Za-z_:][\w:]*", text):
        name = match.group(0)
        if name.lower() in PROMQL_KEYWORDS or re.match(r"\s*\(", text[match.end() :]):
            continue
        names.add(name)
    return names


def promql_matchers(expr: str) -> list[tuple[str, str, str]]:
    """(label, operator, value) of every label matcher in an expression."""
    found = []
    for selector in re.findall(r"\{([^}]*)\}", expr):
        for label, op, value in re.findall(r'(\w+)\s*(=~|!~|!=|=)\s*"((?:[^"\\]|\\.)*)"', selector):
            found.append((label, op, value))
    return found


def promql_selectors(expr: str) -> list[tuple[str, list[tuple[str, str, str]]]]:
    """(metric name, its matchers) of every ``name{...}`` selector."""
    found = []
    for match in re.finditer(r"(?<![\w.$])([A-Za-z_:][\w:]*)\s*\{([^}]*)\}", expr):
        matchers = re.findall(r'(\w+)\s*(=~|!~|!=|=)\s*"((?:[^"\\]|\\.)*)"', match.group(2))
        found.append((match.group(1), matchers))
    return found


def promql_grouping_labels(expr: str) -> set[str]:
    """Labels named in ``by (...)``, ``without (...)``, ``on (...)``, ``ignoring (...)``."""
    labels = set()
    for group in re.findall(r"\b(?:by|without|on|ignoring)\s*\(([^)]*)\)", _blank_strings(expr)):
        labels |= {label.strip() for label in group.split(",") if label.strip()}
    return labels


def promql_problems(expr: str, index: dict[str, list[Metric]], jobs: set[str], source_text: str) -> list[str]:
    """What in ``expr`` names something no service exports; empty when every name exists."""
    problems = []
    names = promql_metric_names(expr)
    if not names:
        problems.append("selects no metric")
    known_labels = set(TARGET_LABELS)
    for name in sorted(names):
        if name in BUILTIN_METRICS:
            continue
        if name not in index:
            problems.append(f"no metric {name} in the services' code")
            continue
        known_labels |= {label for metric in index[name] for label in metric.labels_of(name)}
    for name, matchers in promql_selectors(expr):
        labels = (
            {label for metric in index.get(name, []) for label in metric.labels_of(name)} | TARGET_LABELS
            if name not in BUILTIN_METRICS
            else TARGET_LABELS
        )
        for label, op, value in matchers:
            if name in index and label not in labels:
                problems.append(f"{name} has no label {label} (it has {sorted(labels)})")
            elif label == "job" and op in ("=", "!=") and value not in jobs:
                problems.append(f"no scrape job {value}")
            elif label not in TARGET_LABELS and op in ("=", "!=") and f'"{value}"' not in source_text:
                # A typo in a value makes a panel empty or an alert that never fires.
                problems.append(f"{label}={value!r} is never set in the services' code")
    for label in sorted(promql_grouping_labels(expr) - known_labels):
        problems.append(f"groups by {label}, which none of its metrics has")
    return problems


def run_promtool(*argv: str) -> subprocess.CompletedProcess[str]:
    """promtool with ``argv``; missing, it fails the test (`make install` installs it)."""
    promtool = shutil.which("promtool")
    assert promtool, (
        "promtool is not installed: `make install` installs Debian's prometheus package, "
        "or run `apt-get install prometheus`"
    )
    return subprocess.run(
        [promtool, *argv], capture_output=True, text=True, timeout=60, check=False, cwd=ROOT
    )


def metrics_classes(sources: Iterable[Path] = METRIC_SOURCES) -> list[tuple[str, str]]:
    """(module, class) of every class whose ``__init__`` takes only a ``CollectorRegistry``: the
    services' metrics holders, found by their signature rather than by the calls inside them."""
    found = []
    for path in (p for root in sources for p in sorted(root.rglob("*.py")) if "_pb2" not in p.name):
        for cls in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(cls, ast.ClassDef):
                continue
            for init in cls.body:
                if isinstance(init, ast.FunctionDef) and init.name == "__init__":
                    args = init.args.args[1:]
                    if (
                        len(args) == 1
                        and not init.args.kwonlyargs
                        and args[0].annotation is not None
                        and ast.unparse(args[0].annotation) == "CollectorRegistry"
                    ):
                        found.append((module_name(path), cls.name))
    return found
