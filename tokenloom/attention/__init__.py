"""Attention over the paged KV cache: the op models call and its backends, chosen in one place
(``backend.py``); torch SDPA (``torch_sdpa.py``) is the reference, the CPU kernels (``cpu_decode``,
``cpu_prefill``) and the Triton kernels (kernels/triton/) the fast paths."""

from tokenloom.attention.metadata import AttentionMetadata

__all__ = ["AttentionMetadata"]
