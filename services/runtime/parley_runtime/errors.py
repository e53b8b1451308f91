"""The runtime's error codes."""

from __future__ import annotations

from parley_platform.errors import Catalog, Kind

CATALOG = Catalog("runtime", "The runtime: agents, turns, plugins, custom actions, documents.")
define = CATALOG.define

NO_CHARACTERS = define(
    "NO_CHARACTERS",
    Kind.INVALID_ARGUMENT,
    "The characters directory holds no character file; the runtime refuses to start.",
    hint="add a YAML character, e.g. characters/default.yaml",
)
