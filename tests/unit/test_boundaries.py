"""The import contracts (pyproject.toml, checked by `lint-imports` in `make lint`) cover every package.

The contracts themselves - services import only the generated contract, the platform and the
clients; no service imports another or the CLI; no import cycle inside a package - are enforced
by import-linter. This test makes sure a new package cannot slip past them.
"""

from __future__ import annotations

import tomllib

from support import ROOT

CONFIG = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
SERVICES = {p.name for p in (ROOT / "services").glob("*/parley_*") if (p / "__init__.py").exists()}
LIBS = {p.name for p in (ROOT / "libs").glob("*/parley_*") if (p / "__init__.py").exists()}


def _contract(kind: str) -> dict[str, object]:
    [found] = [c for c in CONFIG["contracts"] if c["type"] == kind]
    return found


def test_every_package_is_a_root_package() -> None:
    assert {"parley_runtime", "parley_gateway"} <= SERVICES
    assert SERVICES | LIBS | {"parley", "parley_cli"} <= set(CONFIG["root_packages"])


def test_every_service_sits_in_the_services_layer() -> None:
    layers = _contract("layers")["layers"]
    assert isinstance(layers, list)
    [service_layer] = [layer for layer in layers if "parley_runtime" in layer]
    assert {name.strip() for name in service_layer.split("|")} == SERVICES


def test_the_cli_may_not_import_a_service() -> None:
    assert set(_contract("forbidden")["forbidden_modules"]) == SERVICES  # type: ignore[arg-type]


def test_every_first_party_package_is_checked_for_cycles() -> None:
    ancestors = set(_contract("acyclic_siblings")["ancestors"])  # type: ignore[arg-type]
    assert SERVICES | (LIBS - {"parley"}) | {"parley_cli"} <= ancestors
