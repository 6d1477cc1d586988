"""Prompt-chunk attention on the CPU through a compiled kernel that reads KV blocks in place.

``csrc/paged_prefill_cpu.cpp`` takes every prompt chunk of a step in one call (tasks of 16 query
rows with AVX-512, 8 with AVX2, x one kv head's heads, pulled by every core), instead of one torch
SDPA call per sequence after gathering its context. Each query row's result is the same bits however its
prompt is split: whole, in chunks, after a prefix-cache hit, or batched with other prompts.
Built for AVX-512 and AVX2 (the fastest this CPU runs). The AVX-512 build takes head sizes
32/64/128/256 and contexts up to ``MAX_CONTEXT``; the AVX2 build (8 queries a task, 16 registers)
is faster than torch only for head sizes up to 64 and contexts up to ``MAX_CONTEXT_AVX2``
(docs/BENCHMARKS.md): the rest runs the torch path.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tokenloom.attention.metadata import AttentionMetadata
from tokenloom.kernels import native

_SOURCE = Path(__file__).parent / "csrc" / "paged_prefill_cpu.cpp"
_BUILDS = (("avx512", "tokenloom_prefill512"), ("avx2", "tokenloom_prefill"))  # (isa, library), fastest first

# Longest context the kernel takes: up to it the kernel is faster than torch's flash attention,
# beyond it torch is (see the kernel's header; docs/BENCHMARKS.md, 'Measurements behind design
# choices').
MAX_CONTEXT = 2048
# The AVX2 build against torch SDPA (attention alone, 2 cores): heads of 64 at 1024 positions
# 1.2-1.4x, at 2000 0.8-1.1x; heads of 128 0.83x at 1024, of 256 0.46x.
MAX_CONTEXT_AVX2 = 1024
AVX2_HEAD_DIMS = (32, 64)


def ops():
    """The kernel's torch.ops namespace, or None where it cannot be built."""
    return native.fastest(_SOURCE, "paged prefill attention kernel", _BUILDS)


def usable(q: torch.Tensor, k_cache) -> bool:
    """Float32 queries on the CPU that the kernel takes (``takes``)."""
    return q.device.type == "cpu" and q.dtype == torch.float32 and takes(q.shape[-1], k_cache)


def takes(head_dim: int, k_cache) -> bool:
    """A plain (not quantized) float32 CPU cache, a head size the build takes, and the kernel built."""
    return (
        isinstance(k_cache, torch.Tensor)
        and k_cache.device.type == "cpu"
        and k_cache.dtype == torch.float32
        and ops() is not None
        and head_dim in (AVX2_HEAD_DIMS if _avx2_build() else (32, 64, 128, 256))
    )


def _avx2_build() -> bool:
    """The kernel loaded is the AVX2 build (this CPU has no AVX-512)."""
    return ops() is getattr(torch.ops, _BUILDS[1][1])


def max_context() -> int:
    """The longest context the loaded build takes (module doc)."""
    return min(MAX_CONTEXT, MAX_CONTEXT_AVX2) if _avx2_build() else MAX_CONTEXT


def prefill_rows(meta: AttentionMetadata) -> list[int]:
    """The sequences of this step the kernel takes: several queries, context <= max_context()."""
    if meta.prefill_rows_ is None:
        longest = max_context()
        meta.prefill_rows_ = [
            i for i, (n, c) in enumerate(zip(meta.query_lens, meta.context_lens)) if n > 1 and c <= longest
        ]
    return meta.prefill_rows_


def _inputs(meta: AttentionMetadata, seqs: list[int]) -> tuple[torch.Tensor, ...]:
    """Padded block tables (S, W) and query starts, query lengths, context lengths (S,) int64."""
    if meta.prefill_kernel_inputs is None:
        per_seq = [
            torch.tensor([field[i] for i in seqs], dtype=torch.int64)
            for field in (meta.query_start, meta.query_lens, meta.context_lens)
        ]
        meta.prefill_kernel_inputs = (meta.padded_block_tables(seqs), *per_seq)
    return meta.prefill_kernel_inputs


def attend_into(
    out: torch.Tensor,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    seqs: list[int],
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
) -> None:
    """Write the attention of `seqs`' query rows of q (T, heads, head_dim) into the same rows of
    out (T, heads, head_dim), each query over its last `window` positions (None: all), scores
    soft-capped by `softcap` if given; their keys/values must be in the cache already."""
    tables, starts, lens, ctx = _inputs(meta, seqs)
    ops().paged_prefill(
        q.contiguous(), k_cache, v_cache, tables, starts, lens, ctx, scale, window or 0, softcap or 0.0, out
    )
