"""``python -m parley_runtime``: run one runtime replica until SIGINT/SIGTERM."""

import sys

from parley_platform.lifecycle import App, run_app
from parley_platform.settings import Settings

from .app import RuntimeApp
from .config import RuntimeSettings


def _make() -> tuple[App, Settings]:
    settings = RuntimeSettings()
    return RuntimeApp(settings), settings


if __name__ == "__main__":
    sys.exit(run_app("runtime", _make))
