"""``python -m tokenloom``: the ``tokenloom`` command."""

import sys

from tokenloom.entrypoints.cli import main

sys.exit(main())
