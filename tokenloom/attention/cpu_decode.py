"""Decode attention on the CPU through a compiled kernel that reads KV blocks in place.

The torch path gathers every sequence's blocks into a padded copy, then runs SDPA on it.
The kernel (``csrc/paged_decode_cpu.cpp``) walks each sequence's block table instead, one
task per (sequence, kv head). It is built for AVX2 and, where the CPU has it, AVX-512
(16-lane dot products reduced 16 at a time, for head sizes 32/64/128/256). It serves every one-query
sequence of a float32 step, whatever else is in the batch, so a sequence decodes with the
same arithmetic alone or batched.

A cache of float32 tensors runs ``paged_decode``. The quantized caches read as float32 run
kernels that read their codes and scales where they lie, a few positions at a time converted
to float in a tile every query head of the kv head then reads: the float kernel's attention over
the dequantized cache, up to float rounding.

- ``Int8Cache``: ``paged_decode_int8``, the codes converted unscaled and each per-(slot, kv
  head) scale applied once per position (to a key's dot products, to the softmax weights of a
  value).
- ``Int4Cache`` (q4_0, head_dim a multiple of 32): ``paged_decode_int4``, each group of 32
  elements unpacked from its 16 bytes and scaled by its float16 scale into the tile, as
  ``Int4Cache``'s reads round it ((code - 8) * d).
- ``HalfCache`` (float16 or bfloat16): ``paged_decode_half``, each element widened to float32
  exactly, as ``HalfCache``'s reads widen it.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tokenloom.attention.metadata import AttentionMetadata
from tokenloom.kernels import native
from tokenloom.kv_cache.quantized import INT4_GROUP, HalfCache, Int4Cache, Int8Cache

_SOURCE = Path(__file__).parent / "csrc" / "paged_decode_cpu.cpp"
BUILDS = (("avx512", "tokenloom_attention512"), ("avx2", "tokenloom_attention"))  # (isa, library), fastest first


def ops():
    """The fastest build of the kernel this CPU runs (torch.ops namespace), or None."""
    return native.fastest(_SOURCE, "paged decode attention kernel", BUILDS)


def build() -> bool:
    """Compile and register the kernel (once per process); False where it cannot be."""
    return ops() is not None


def usable(q: torch.Tensor, k_cache) -> bool:
    """The kernel handles this step: float32 queries on the CPU, a cache it reads (``takes_cache``),
    and it compiled."""
    return q.device.type == "cpu" and q.dtype == torch.float32 and takes_cache(k_cache) and build()


def takes_cache(k_cache) -> bool:
    """A cache layer the kernel reads: a float32 tensor, or an Int8Cache, Int4Cache (head_dim a
    multiple of 32) or HalfCache on the CPU read as float32."""
    if isinstance(k_cache, Int4Cache) and k_cache.shape[-1] % INT4_GROUP:
        return False
    if isinstance(k_cache, (Int8Cache, Int4Cache, HalfCache)):
        return k_cache.dtype == torch.float32 and k_cache.data.device.type == "cpu"
    return isinstance(k_cache, torch.Tensor) and k_cache.dtype == torch.float32


def decode_rows(meta: AttentionMetadata) -> list[int]:
    """The sequences of this step with a single query (decoding)."""
    if meta.decode_rows_ is None:
        meta.decode_rows_ = [i for i, n in enumerate(meta.query_lens) if n == 1]
    return meta.decode_rows_


def decode_inputs(meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """Padded block tables and context lengths of the step's decoding sequences."""
    return _inputs(meta, decode_rows(meta))


def _inputs(meta: AttentionMetadata, seqs: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Padded block tables (S, W) int64 and context lengths (S,) of `seqs`; same for every layer.
    W is a power of two: a growing context changes the step's shapes (and re-records its
    tape, layers/op_tape.py) log2 times, not every block."""
    if meta.decode_kernel_inputs is None:
        meta.decode_kernel_inputs = (
            meta.padded_block_tables(seqs, power_of_two=True),
            torch.tensor([meta.context_lens[i] for i in seqs], dtype=torch.int64),
        )
    return meta.decode_kernel_inputs


def attend(
    q: torch.Tensor,
    k_cache: torch.Tensor | Int8Cache | Int4Cache | HalfCache,
    v_cache: torch.Tensor | Int8Cache | Int4Cache | HalfCache,
    meta: AttentionMetadata,
    seqs: list[int],
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """q (S, heads, head_dim): the query of each sequence in `seqs` -> (S, heads, head_dim), each
    attending to its last `window` positions (None: all), scores soft-capped by `softcap` if given,
    each head's sink logit (sinks (heads,)) counted in its softmax if given. The caches are both
    float32 tensors, or both Int8Caches, Int4Caches or HalfCaches (``usable``)."""
    tables, ctx = _inputs(meta, seqs)
    q, window_, softcap_ = q.contiguous(), window or 0, softcap or 0.0
    if isinstance(k_cache, Int8Cache):
        assert isinstance(v_cache, Int8Cache)  # keys and values are stored alike
        return ops().paged_decode_int8(
            q, k_cache.data, k_cache.scales, v_cache.data, v_cache.scales, tables, ctx, scale, window_, softcap_, sinks
        )
    if isinstance(k_cache, Int4Cache):
        assert isinstance(v_cache, Int4Cache)
        return ops().paged_decode_int4(
            q, k_cache.data, k_cache.scales, v_cache.data, v_cache.scales, tables, ctx, scale, window_, softcap_, sinks
        )
    if isinstance(k_cache, HalfCache):
        assert isinstance(v_cache, HalfCache)
        return ops().paged_decode_half(q, k_cache.data, v_cache.data, tables, ctx, scale, window_, softcap_, sinks)
    return ops().paged_decode(q, k_cache, v_cache, tables, ctx, scale, window_, softcap_, sinks)
