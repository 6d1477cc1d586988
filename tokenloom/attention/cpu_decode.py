"""Decode attention on the CPU through a compiled kernel that reads KV blocks in place.

The torch path gathers every sequence's blocks into a padded copy, then runs SDPA on it.
The kernel (``csrc/paged_decode_cpu.cpp``) walks each sequence's block table instead, one
task per (sequence, kv head). It is built for AVX2 and, where the CPU has it, AVX-512
(16-lane dot products reduced 16 at a time, for head sizes 32/64/128/256). It serves every one-query
sequence of a float32 step, whatever else is in the batch, so a sequence decodes with the
same arithmetic alone or batched.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tokenloom.attention.metadata import AttentionMetadata
from tokenloom.kernels import native

_SOURCE = Path(__file__).parent / "csrc" / "paged_decode_cpu.cpp"
BUILDS = (("avx512", "tokenloom_attention512"), ("avx2", "tokenloom_attention"))  # (isa, library), fastest first


def ops():
    """The fastest build of the kernel this CPU runs (torch.ops namespace), or None."""
    return native.fastest(_SOURCE, "paged decode attention kernel", BUILDS)


def build() -> bool:
    """Compile and register the kernel (once per process); False where it cannot be."""
    return ops() is not None


def usable(q: torch.Tensor, k_cache) -> bool:
    """The kernel handles this step: float32 on the CPU, a plain (not int8) cache, and it compiled."""
    return (
        q.device.type == "cpu"
        and q.dtype == torch.float32
        and isinstance(k_cache, torch.Tensor)
        and k_cache.dtype == torch.float32
        and build()
    )


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
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    seqs: list[int],
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """q (S, heads, head_dim): the query of each sequence in `seqs` -> (S, heads, head_dim), each
    attending to its last `window` positions (None: all), scores soft-capped by `softcap` if given,
    each head's sink logit (sinks (heads,)) counted in its softmax if given."""
    tables, ctx = _inputs(meta, seqs)
    return ops().paged_decode(q.contiguous(), k_cache, v_cache, tables, ctx, scale, window or 0, softcap or 0.0, sinks)
