"""Services share only libs/platform and proto/: no service imports another, nor the CLI, nor the
development infrastructure (parley_devinfra, for the CLI and the tests only)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from support import ROOT

SERVICE_PACKAGES = {
    package.name: package
    for package in (ROOT / "services").glob("*/parley_*")
    if (package / "__init__.py").exists()
}
PACKAGES = {
    **SERVICE_PACKAGES,
    "parley_platform": ROOT / "libs" / "platform" / "parley_platform",
    "parley_devinfra": ROOT / "libs" / "devinfra" / "parley_devinfra",
    "parley_cli": ROOT / "cli" / "parley_cli",
}
SHARED = {"parley", "parley_platform"}
ALLOWED = {name: SHARED | {name} for name in PACKAGES}
ALLOWED["parley_cli"] |= {"parley_devinfra"}


def test_every_service_is_checked() -> None:
    assert {"parley_runtime", "parley_gateway"} <= set(SERVICE_PACKAGES)


def _first_party_imports(package: Path) -> set[tuple[str, str]]:
    found = set()
    for path in package.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            for name in names:
                top = name.split(".")[0]
                if top.startswith("parley"):
                    found.add((path.name, top))
    return found


@pytest.mark.parametrize("package", sorted(PACKAGES))
def test_imports_stay_inside_their_boundary(package: str) -> None:
    imports = _first_party_imports(PACKAGES[package])
    assert imports, f"{package}: found no imports at all; is the path right?"
    crossing = sorted((file, top) for file, top in imports if top not in ALLOWED[package])
    assert crossing == [], f"{package} imports across a boundary: {crossing}"
