"""Error codes raised by the service clients themselves (not by the services they call)."""

from __future__ import annotations

from parley_platform.errors import Catalog, Kind

CATALOG = Catalog("clients", "Raised on the caller's side by the clients in libs/clients.")

BATCHER_DISPOSED = CATALOG.define(
    "BATCHER_DISPOSED",
    Kind.FAILED_PRECONDITION,
    "The batcher client was disposed: it takes no more sections and its waits end.",
)
