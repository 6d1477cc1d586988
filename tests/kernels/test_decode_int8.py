"""The CPU decode kernel over an int8 KV cache (paged_decode_int8: codes and scales read in
place) against attention in float64 over the same cache dequantized by Int8Cache itself. That
reference at every head size, windows, soft-capping, sinks and batch/thread invariance are checked
for int8 and int4 alike in test_decode_int4.py."""

from __future__ import annotations

import pytest
import torch

from tokenloom.attention import cpu_decode
from tokenloom.attention.metadata import AttentionMetadata
from tokenloom.kernels import native
from tokenloom.kv_cache.quantized import Int8Cache

pytestmark = pytest.mark.skipif(not native.cpu_has_avx2(), reason="the kernel needs AVX2 + FMA")

BS = 16


def int8_cache(num_blocks: int, kv_heads: int, head_dim: int, gen: torch.Generator) -> Int8Cache:
    """An Int8Cache of random rows of varied magnitude (so the scales differ), the null block zero."""
    cache = Int8Cache(
        torch.zeros(num_blocks + 1, BS, kv_heads, head_dim, dtype=torch.int8),
        torch.zeros(num_blocks + 1, BS, kv_heads),
        torch.float32,
    )
    x = torch.randn(num_blocks * BS, kv_heads, head_dim, generator=gen)
    x *= torch.exp(torch.randn(num_blocks * BS, kv_heads, 1, generator=gen))
    cache.store(torch.arange(num_blocks * BS), x)
    return cache


def paged_int8(lens: list[int], heads: int, kv_heads: int, head_dim: int, seed: int = 0):
    """Key and value caches, each sequence's blocks scattered, one query per sequence."""
    return paged(lambda n, gen: int8_cache(n, kv_heads, head_dim, gen), lens, heads, head_dim, seed)


def paged(make_cache, lens: list[int], heads: int, head_dim: int, seed: int):
    """(keys, values, block tables, queries): two caches of random rows from `make_cache(num_blocks,
    gen)`, just big enough for `lens`; each sequence's blocks taken in turn from a random order of the
    cache's, so no two sequences share one and none lies next to the one before; one query each."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-n // BS) for n in lens) + 3
    k, v = make_cache(num_blocks, gen), make_cache(num_blocks, gen)
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables, used = [], 0
    for n in lens:
        tables.append(torch.tensor(order[used : used + -(-n // BS)]))
        used += len(tables[-1])
    return k, v, tables, torch.randn(len(lens), heads, head_dim, generator=gen)


def decode_meta(lens: list[int], tables: list[torch.Tensor], null_block: int) -> AttentionMetadata:
    n = len(lens)
    return AttentionMetadata(torch.zeros(n, dtype=torch.long), list(range(n)), [1] * n, list(lens), tables, null_block)


def reference(q, k, v, lens, tables, scale, window=None, softcap=None, sinks=None) -> torch.Tensor:
    """Each sequence's attention in float64 over its keys and values as the caches read them
    (dequantized by their own indexing: Int8Cache's, Int4Cache's)."""
    heads, outs = q.shape[1], []
    for b, (n, table) in enumerate(zip(lens, tables)):
        first = max(0, n - window) if window else 0
        keys = k[table].flatten(0, 1)[first:n].double()  # (positions, kv_heads, head_dim), dequantized
        values = v[table].flatten(0, 1)[first:n].double()
        group = heads // keys.shape[1]
        keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
        scores = torch.einsum("hd,thd->ht", q[b].double(), keys) * scale
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        if sinks is not None:  # a score with no value behind it
            scores = torch.cat([scores, sinks.double()[:, None]], dim=1)
        weights = torch.softmax(scores, dim=1)[:, : keys.shape[0]]
        outs.append(torch.einsum("ht,thd->hd", weights, values))
    return torch.stack(outs)


def attend(q, k, v, lens, tables, scale, window=None, softcap=None, sinks=None) -> torch.Tensor:
    meta = decode_meta(lens, tables, k.data.shape[0] - 1)
    return cpu_decode.attend(q, k, v, meta, list(range(len(lens))), scale, window, softcap, sinks)


def spy_on_attend(monkeypatch, seen: list) -> None:
    """Record the key cache of every cpu_decode.attend call (the kernel's entry) in `seen`."""
    attend_kernel = cpu_decode.attend

    def spy(q, k_cache, *args, **kwargs):
        seen.append(k_cache)
        return attend_kernel(q, k_cache, *args, **kwargs)

    monkeypatch.setattr(cpu_decode, "attend", spy)


def assert_matches(got: torch.Tensor, want: torch.Tensor) -> None:
    """The dequantized cache's result, float32 rounding apart: within 2e-6 of the largest output
    (the float kernel over the dequantized cache is off by up to ~1e-6 of it too)."""
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=2e-6 * want.abs().max().item())


def test_int8_kernel_reads_nothing_past_a_context(kernel_build):
    """Slots after each sequence's last position (and every block not in its table) may hold
    anything, NaN scales included: the kernel reads only the context, so no clearing is needed
    (backend.reads_past_context)."""
    lens = [3, 17, 40]
    k, v, tables, q = paged_int8(lens, 4, 2, 64, seed=2)
    want = attend(q, k, v, lens, tables, 0.2)
    rows = torch.tensor([int(table[p // BS]) * BS + p % BS for n, table in zip(lens, tables) for p in range(n)])
    for cache in (k, v):
        data = cache.data.view(-1, *cache.data.shape[2:])
        scales = cache.scales.view(-1, cache.scales.shape[-1])
        kept = data[rows].clone(), scales[rows].clone()
        data.fill_(127)
        scales.fill_(float("nan"))
        data[rows], scales[rows] = kept
    assert torch.equal(attend(q, k, v, lens, tables, 0.2), want)
