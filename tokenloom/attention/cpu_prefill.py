"""Prompt-chunk attention on the CPU through a compiled kernel that reads KV blocks in place.

``csrc/paged_prefill_cpu.cpp`` takes every prompt chunk of a step in one call (tasks of up to
16 groups of 16 query rows with AVX-512, of 8 with AVX2, x one kv head's heads, walking the keys in
L1-sized tiles; pulled by every core), instead of one torch SDPA call per sequence after gathering
its context. Each query row's result is the same bits however its prompt is split: whole, in
chunks, after a prefix-cache hit, or batched with other prompts. Built for AVX-512 and AVX2 (the
fastest this CPU runs); both take head sizes 32/64/128/256 (``HEAD_DIMS``) and every cache format:
float32, or 16-bit, int8 and int4 blocks widened to float32 as each tile is copied (the values the
cache layer's own reads give, so the same bits as over its dequantized copy).

Measured against torch SDPA (the path prompt rows take otherwise), the attention alone, one
sequence, 2 threads, AVX2 build on a 2-core AMD EPYC, medians of interleaved runs on a loaded
machine, torch time / kernel time: a 1,024-row chunk (the CPU's default step) at a context of
16,384: heads of 32 (9 / 3 kv heads) 1.9x, 64 (14 / 2) 1.4x, 128 (12 / 2) 1.2x, 256 (4 / 1)
1.04x; at 32,768 with heads of 64, 1.4x; whole prompts of 16,384 with heads of 128, 1.16x, and of
8,192 with heads of 256, 1.02x. No length measured lost, so the kernel takes every context
(``MAX_CONTEXT`` None); a bound set there sends longer contexts to torch.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tokenloom.attention.metadata import AttentionMetadata
from tokenloom.kernels import native
from tokenloom.kv_cache.quantized import HalfCache, QuantizedKV

_SOURCE = Path(__file__).parent / "csrc" / "paged_prefill_cpu.cpp"
_BUILDS = (("avx512", "tokenloom_prefill512"), ("avx2", "tokenloom_prefill"))  # (isa, library), fastest first

# Longest context the kernel takes; None: any (module doc).
MAX_CONTEXT: int | None = None
HEAD_DIMS = (32, 64, 128, 256)


def ops():
    """The kernel's torch.ops namespace, or None where it cannot be built."""
    return native.fastest(_SOURCE, "paged prefill attention kernel", _BUILDS)


def usable(q: torch.Tensor, k_cache) -> bool:
    """Float32 queries on the CPU that the kernel takes (``takes``)."""
    return q.device.type == "cpu" and q.dtype == torch.float32 and takes(q.shape[-1], k_cache)


def takes(head_dim: int, k_cache) -> bool:
    """A float32 CPU cache, or a stored-format one (HalfCache, Int8Cache, Int4Cache) read as
    float32 on the CPU; a head size in HEAD_DIMS; and the kernel built."""
    if isinstance(k_cache, QuantizedKV):
        cache_ok = k_cache.dtype == torch.float32 and k_cache.data.device.type == "cpu"
    else:
        cache_ok = isinstance(k_cache, torch.Tensor) and k_cache.device.type == "cpu" and k_cache.dtype == torch.float32
    return cache_ok and head_dim in HEAD_DIMS and ops() is not None


def cache_arrays(k_cache, v_cache) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(keys, values, key scales, value scales) as the kernels take a cache layer pair: a float32
    tensor or a HalfCache's elements with no scales, an Int8Cache's/Int4Cache's codes with theirs."""
    if not isinstance(k_cache, QuantizedKV):
        return k_cache, v_cache, None, None
    assert isinstance(v_cache, QuantizedKV)  # keys and values are stored alike
    if isinstance(k_cache, HalfCache):
        return k_cache.data, v_cache.data, None, None
    return k_cache.data, v_cache.data, k_cache.scales, v_cache.scales


def prefill_rows(meta: AttentionMetadata) -> list[int]:
    """The sequences of this step the kernel takes: several queries, context <= MAX_CONTEXT (if set)."""
    if meta.prefill_rows_ is None:
        longest = MAX_CONTEXT
        meta.prefill_rows_ = [
            i
            for i, (n, c) in enumerate(zip(meta.query_lens, meta.context_lens))
            if n > 1 and (longest is None or c <= longest)
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
    k_cache,
    v_cache,
    meta: AttentionMetadata,
    seqs: list[int],
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
) -> None:
    """Write the attention of `seqs`' query rows of q (T, heads, head_dim) into the same rows of
    out (T, heads, head_dim), each query over its last `window` positions (None: all), scores
    soft-capped by `softcap` if given; their keys/values must be in the cache already (a float32
    tensor or a stored-format layer, ``takes``)."""
    tables, starts, lens, ctx = _inputs(meta, seqs)
    keys, values, k_scales, v_scales = cache_arrays(k_cache, v_cache)
    step = (tables, starts, lens, ctx, scale, window or 0, softcap or 0.0)
    ops().paged_prefill(q.contiguous(), keys, values, *step, out, k_scales, v_scales)
