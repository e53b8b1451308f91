"""``python -m parley_web``: run one web connector replica until SIGINT/SIGTERM."""

import sys

from parley_platform.host import run_service

from .app import SPEC, setup
from .config import WebSettings

if __name__ == "__main__":
    sys.exit(run_service(SPEC, WebSettings(), setup))
