"""The error a split model's ranks raise when another rank is gone."""

from __future__ import annotations


class ParallelRankError(RuntimeError):
    """Another rank stopped answering (it died, or its link did): the engine cannot go on."""
