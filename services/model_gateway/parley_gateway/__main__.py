"""``python -m parley_gateway``: run one model-gateway replica until SIGINT/SIGTERM."""

import sys

from parley_platform.lifecycle import run_app

from .app import SPEC, create
from .config import GatewaySettings

if __name__ == "__main__":
    settings = GatewaySettings()
    sys.exit(run_app(SPEC.name, lambda: (create(settings), settings)))
