"""Error codes live in catalogs: raise sites use catalog entries, and docs/errors.md is current."""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest

from support import ROOT

KIND_CLASSES = {
    "ParleyError",
    "InvalidArgument",
    "NotFound",
    "Conflict",
    "FailedPrecondition",
    "ResourceExhausted",
    "Unauthenticated",
    "PermissionDenied",
    "Unavailable",
    "DeadlineExceeded",
    "Internal",
}
PACKAGES = sorted(
    [p for p in (ROOT / "services").glob("*/parley_*") if (p / "__init__.py").exists()]
    + [p for p in (ROOT / "libs").glob("*/parley_*") if (p / "__init__.py").exists()],
    key=lambda p: p.name,
)
CATALOG_FILES = {"errors.py", "codes.py"}


def _generator() -> object:
    spec = importlib.util.spec_from_file_location("gen_errors", ROOT / "tools" / "gen_errors.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_docs_errors_is_generated_from_the_catalogs() -> None:
    fresh = _generator().render()  # type: ignore[attr-defined]
    assert (ROOT / "docs" / "errors.md").read_text() == fresh, "stale: run `make gen`"


def test_every_service_has_a_catalog() -> None:
    modules = _generator().CATALOG_MODULES  # type: ignore[attr-defined]
    # Services on the service host (an app.py) answer with error codes on the wire; the chat
    # connector processes (telegram, slack) have no API and exit with their own configuration errors.
    services = {p.name for p in PACKAGES if p.parent.parent.name == "services" and (p / "app.py").exists()}
    assert {f"{name}.errors" for name in services} <= set(modules)


def _raise_sites(package: Path) -> list[str]:
    """Errors built from a kind class instead of a catalog entry, and error types whose code is a
    literal instead of a catalog entry's."""
    found = []
    for path in package.rglob("*.py"):
        if path.name in CATALOG_FILES:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Assign | ast.AnnAssign):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                named = any(isinstance(t, ast.Name) and t.id == "default_code" for t in targets)
                if named and isinstance(node.value, ast.Constant):
                    found.append(
                        f"{path.relative_to(ROOT)}:{node.lineno} default_code = {node.value.value!r}"
                    )
            call = isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
            if call and node.func.id in KIND_CLASSES:  # type: ignore[attr-defined]
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.func.id}(...)")  # type: ignore[attr-defined]
    return found


@pytest.mark.parametrize("package", PACKAGES, ids=lambda p: p.name)
def test_errors_are_raised_from_the_catalog(package: Path) -> None:
    assert _raise_sites(package) == []
