"""``python -m parley_runtime``: run one runtime replica until SIGINT/SIGTERM."""

import sys

from parley_platform.host import run_service

from .app import SPEC, setup
from .config import RuntimeSettings

if __name__ == "__main__":
    sys.exit(run_service(SPEC, RuntimeSettings(), setup))
