"""``python -m parley_pairing``: run one pairing replica until SIGINT/SIGTERM."""

import sys

from parley_platform.host import run_service

from .app import SPEC, setup
from .config import PairingSettings

if __name__ == "__main__":
    sys.exit(run_service(SPEC, PairingSettings(), setup))
