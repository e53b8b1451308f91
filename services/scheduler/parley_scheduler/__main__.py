"""``python -m parley_scheduler``: run one scheduler replica until SIGINT/SIGTERM."""

import sys

from parley_platform.host import run_service

from .app import SPEC, setup
from .config import SchedulerSettings

if __name__ == "__main__":
    sys.exit(run_service(SPEC, SchedulerSettings(), setup))
