"""``python -m parley_authz``: run one authz replica until SIGINT/SIGTERM."""

import sys

from parley_platform.lifecycle import App, run_app
from parley_platform.settings import Settings

from .app import AuthzApp
from .config import AuthzSettings


def _make() -> tuple[App, Settings]:
    settings = AuthzSettings()
    return AuthzApp(settings), settings


if __name__ == "__main__":
    sys.exit(run_app("authz", _make))
