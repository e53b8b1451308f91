"""``python -m parley_scheduler``: run one scheduler replica until SIGINT/SIGTERM."""

import sys

from parley_platform.lifecycle import App, run_app
from parley_platform.settings import Settings

from .app import SchedulerApp
from .config import SchedulerSettings


def _make() -> tuple[App, Settings]:
    settings = SchedulerSettings()
    return SchedulerApp(settings), settings


if __name__ == "__main__":
    sys.exit(run_app("scheduler", _make))
