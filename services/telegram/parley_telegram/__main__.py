import sys

from .connector import main

sys.exit(main())
