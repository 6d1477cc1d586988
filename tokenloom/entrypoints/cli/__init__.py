"""The ``tokenloom`` command: ``commands.py`` parses and dispatches, one module per concern beside it.

This package module stays light (no torch): ``console_main`` sets the process up before the
commands, and torch with them, are imported.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
from typing import NoReturn

from tokenloom.entrypoints.cli.collection import pause_collection

__all__ = ["console_main", "main"]


def main(argv: list[str] | None = None) -> int:
    """Run the command `argv` (default: sys.argv[1:]); its exit code."""
    from tokenloom.entrypoints.cli.commands import main as run

    return run(argv)


def console_main() -> NoReturn:
    """The ``tokenloom`` command as a process.

    The garbage collector is paused until the model is loaded (collection.py). After
    ``main()``, the exit handlers run (``atexit``: a chat's history save, worker shutdowns,
    logging's flush) and the process exits without Python's teardown of every module, which
    takes about half a second once torch is imported. A process with a thread still running exits the usual way."""
    pause_collection()
    code = main()
    if "torch" not in sys.modules or any(
        t.is_alive() and not t.daemon for t in threading.enumerate() if t is not threading.main_thread()
    ):
        sys.exit(code)
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (BrokenPipeError, ValueError):  # a reader that left (`| head`); a closed stream
            pass
    os._exit(code)
