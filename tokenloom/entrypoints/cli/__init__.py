"""The ``tokenloom`` command: ``main.py`` parses and dispatches, one module per concern beside it."""

from tokenloom.entrypoints.cli.commands import main

__all__ = ["main"]
