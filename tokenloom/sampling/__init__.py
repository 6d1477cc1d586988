"""Logits -> processors -> selection, batched over requests with different params."""

from tokenloom.sampling.metadata import SamplingMetadata
from tokenloom.sampling.sampler import Sampler

__all__ = ["Sampler", "SamplingMetadata"]
