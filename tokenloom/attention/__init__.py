"""Attention over the paged KV cache. ``torch_sdpa`` is the CPU reference backend."""

from tokenloom.attention.metadata import AttentionMetadata
from tokenloom.attention.torch_sdpa import paged_attention, reads_past_context

__all__ = ["AttentionMetadata", "paged_attention", "reads_past_context"]
