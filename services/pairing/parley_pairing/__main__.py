"""``python -m parley_pairing``: run one pairing replica until SIGINT/SIGTERM."""

import sys

from parley_platform.lifecycle import App, run_app
from parley_platform.settings import Settings

from .app import PairingApp
from .config import PairingSettings


def _make() -> tuple[App, Settings]:
    settings = PairingSettings()
    return PairingApp(settings), settings


if __name__ == "__main__":
    sys.exit(run_app("pairing", _make))
