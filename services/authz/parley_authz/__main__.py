"""``python -m parley_authz``: run one authz replica until SIGINT/SIGTERM."""

import sys

from parley_platform.host import run_service

from .app import SPEC, setup
from .config import AuthzSettings

if __name__ == "__main__":
    sys.exit(run_service(SPEC, AuthzSettings(), setup))
