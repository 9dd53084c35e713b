"""`python -m pocketlab generate|chat PATH ...`: see pocketlab.cli."""

import sys

from .cli import main

sys.exit(main())
