"""The ``tokenloom`` command: ``main.py`` parses and dispatches, one module per concern beside it."""

from __future__ import annotations

import atexit
import os
import sys
import threading
from typing import NoReturn

from tokenloom.entrypoints.cli.commands import main

__all__ = ["console_main", "main"]


def console_main() -> NoReturn:
    """The ``tokenloom`` command as a process: ``main()``, then the exit handlers (``atexit``:
    a chat's history save, worker shutdowns, logging's flush) and the exit, without Python's
    teardown of every module where torch was imported: that takes about half a second after
    the answer is printed. A process with a thread still running exits the usual way."""
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
