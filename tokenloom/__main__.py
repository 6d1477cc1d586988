"""``python -m tokenloom``: the ``tokenloom`` command."""

from tokenloom.entrypoints.cli import console_main

console_main()
