"""Logits -> processors -> filter chain -> selection, batched over requests with different params.

`Sampler` and `SamplingMetadata` load on first use, so modules the sampler itself imports (the
request, its outputs) can use this package's small parts (state.py) without a cycle.
"""

__all__ = ["Sampler", "SamplingMetadata"]


def __getattr__(name: str):
    if name == "Sampler":
        from tokenloom.sampling.sampler import Sampler

        return Sampler
    if name == "SamplingMetadata":
        from tokenloom.sampling.metadata import SamplingMetadata

        return SamplingMetadata
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
