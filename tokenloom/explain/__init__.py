"""The generation inspector: per-step records of what the sampler saw, cut and picked."""

from tokenloom.explain.records import CUT_REASONS, Candidate, StepRecord

__all__ = ["CUT_REASONS", "Candidate", "StepRecord"]
