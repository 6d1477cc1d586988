"""The garbage collector around a ``tokenloom`` process's start-up (``console_main`` pauses it)."""

from __future__ import annotations

import gc

_paused = False


def pause_collection() -> None:
    """Stop collecting until ``resume_collection``: start-up makes about a million long-lived
    objects (torch's modules, a vocabulary), and the collector's full passes over them find
    nothing (three of them, ~0.2 s, in one `generate`)."""
    global _paused
    gc.disable()
    _paused = True


def resume_collection() -> None:
    """Once a command's model is loaded: where ``pause_collection`` paused the collector, the
    objects made so far leave its view (``gc.freeze``: torch's modules, the model, the vocabulary
    are never garbage) and collection resumes for what the command makes from then on."""
    global _paused
    if _paused:
        gc.freeze()
        gc.enable()
        _paused = False
