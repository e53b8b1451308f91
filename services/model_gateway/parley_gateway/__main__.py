"""``python -m parley_gateway``: run one model-gateway replica until SIGINT/SIGTERM."""

import sys

from parley_platform.lifecycle import App, run_app
from parley_platform.settings import Settings

from .app import GatewayApp
from .config import GatewaySettings


def _make() -> tuple[App, Settings]:
    settings = GatewaySettings()
    return GatewayApp(settings), settings


if __name__ == "__main__":
    sys.exit(run_app("model-gateway", _make))
