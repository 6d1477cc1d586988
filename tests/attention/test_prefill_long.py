"""The CPU prompt-attention kernel (cpu_prefill) at long contexts: lengths around every key
tile edge (tiles of 16-128 keys at multiples of the tile in absolute positions) and block edge,
several sequences with different prefixes in one call, windows, soft-capped scores and GQA,
against float64 attention; and a row's bits whatever rows share its call."""

from __future__ import annotations

import itertools

import pytest
import torch

from tokenloom.attention import cpu_prefill
from tokenloom.attention.metadata import AttentionMetadata

pytestmark = [
    pytest.mark.skipif(cpu_prefill.ops() is None, reason="the kernel needs an AVX2 CPU and a compiler"),
    pytest.mark.usefixtures("prefill_build"),  # every test on each build this CPU runs (AVX-512, AVX2)
]

BS = 16


def caches(blocks: int, kv_heads: int, head_dim: int, seed: int = 0):
    """Random key and value caches of `blocks` blocks and the null block (last, zero)."""
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(blocks + 1, BS, kv_heads, head_dim, generator=gen)
    v = torch.randn(blocks + 1, BS, kv_heads, head_dim, generator=gen)
    k[blocks] = v[blocks] = 0
    return k, v


def setup(q_lens, ctx_lens, heads, kv_heads, head_dim, seed=0):
    """Caches, scattered block tables, metadata and queries for sequences (q_len, ctx_len)."""
    need = [-(-c // BS) for c in ctx_lens]
    k, v = caches(sum(need), kv_heads, head_dim, seed)
    order = torch.randperm(sum(need), generator=torch.Generator().manual_seed(seed + 1))
    tables = list(torch.split(order, need))
    starts = [sum(q_lens[:i]) for i in range(len(q_lens))]
    meta = AttentionMetadata(
        torch.zeros(sum(q_lens), dtype=torch.long), starts, list(q_lens), list(ctx_lens), tables, null_block=sum(need)
    )
    q = torch.randn(sum(q_lens), heads, head_dim, generator=torch.Generator().manual_seed(seed + 2))
    return q, k, v, meta


def kernel(q, k, v, meta, scale, window=None, softcap=None) -> torch.Tensor:
    out = torch.full_like(q, float("nan"))
    cpu_prefill.attend_into(out, q, k, v, meta, list(range(meta.num_seqs)), scale, window, softcap)
    return out


def reference(q, k, v, meta, scale, window=None, softcap=None, rows=256) -> torch.Tensor:
    """Float64 causal attention of each sequence's rows over its gathered context, `rows`
    queries at a time (long contexts)."""
    out = torch.empty(q.shape, dtype=torch.float64)
    group = q.shape[1] // k.shape[2]
    for start, q_len, ctx, table in zip(meta.query_start, meta.query_lens, meta.context_lens, meta.block_tables):
        keys = k[table].reshape(-1, *k.shape[2:])[:ctx].double().repeat_interleave(group, 1)  # (ctx, heads, d)
        vals = v[table].reshape(-1, *v.shape[2:])[:ctx].double().repeat_interleave(group, 1)
        for a in range(0, q_len, rows):
            b = min(q_len, a + rows)
            scores = torch.einsum("qhd,khd->hqk", q[start + a : start + b].double(), keys) * scale
            if softcap:
                scores = torch.tanh(scores / softcap) * softcap
            q_pos, k_pos = torch.arange(ctx - q_len + a, ctx - q_len + b)[:, None], torch.arange(ctx)[None, :]
            allowed = k_pos <= q_pos
            if window:
                allowed &= k_pos > q_pos - window
            weights = scores.masked_fill(~allowed, -torch.inf).softmax(-1)
            out[start + a : start + b] = torch.einsum("hqk,khd->qhd", weights, vals)
    return out


# (query rows, context) per sequence: whole prompts and chunks after a prefix, ending or
# starting around tile edges (16, 32, 64, 128 keys) and block edges (16 positions)
EDGES = [(15, 15), (16, 16), (17, 17), (31, 31), (2, 32), (33, 33), (63, 63), (64, 64), (9, 65), (127, 127)]
EDGES += [(128, 128), (100, 129), (255, 255), (40, 256), (257, 257), (511, 513), (64, 1023), (1025, 1025)]
LONG = [(2999, 2999), (1500, 5003)]


@pytest.mark.parametrize(
    "heads,kv_heads,head_dim", [(14, 2, 64), (12, 2, 128), (4, 1, 256), (9, 3, 32), (5, 5, 64), (8, 1, 64)]
)
def test_tile_and_block_edges_equal_float64_attention(heads, kv_heads, head_dim):
    q_lens, ctx_lens = [n for n, _ in EDGES], [c for _, c in EDGES]
    q, k, v, meta = setup(q_lens, ctx_lens, heads, kv_heads, head_dim)
    got = kernel(q, k, v, meta, head_dim**-0.5)
    torch.testing.assert_close(got.double(), reference(q, k, v, meta, head_dim**-0.5), atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(7, 1, 64), (6, 1, 128)])
def test_long_contexts_equal_float64_attention(heads, kv_heads, head_dim):
    q_lens, ctx_lens = [n for n, _ in LONG], [c for _, c in LONG]
    q, k, v, meta = setup(q_lens, ctx_lens, heads, kv_heads, head_dim, seed=3)
    got = kernel(q, k, v, meta, head_dim**-0.5)
    torch.testing.assert_close(got.double(), reference(q, k, v, meta, head_dim**-0.5), atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("window,softcap", [(512, None), (100, None), (512, 5.0), (None, 5.0)])
def test_windows_and_soft_caps_at_long_contexts(window, softcap):
    """Gemma-3's shape (4 heads of 256 on one kv head, 512-position windows) and Gemma 2's
    soft-cap (queries scaled up so raw scores pass the cap) over ~3000-position contexts."""
    seqs = [(2000, 2999), (700, 700), (33, 1200), (517, 517)]
    q_lens, ctx_lens = [n for n, _ in seqs], [c for _, c in seqs]
    q, k, v, meta = setup(q_lens, ctx_lens, 4, 1, 256, seed=5)
    q *= 4 if softcap else 1
    got = kernel(q, k, v, meta, 256**-0.5, window, softcap)
    want = reference(q, k, v, meta, 256**-0.5, window, softcap)
    torch.testing.assert_close(got.double(), want, atol=5e-6, rtol=1e-5)


@pytest.mark.parametrize("head_dim,window", [(64, None), (128, None), (256, 512)])
def test_a_long_prompt_gets_the_same_bits_whole_chunked_or_batched(head_dim, window):
    """A 3000-token prompt whole, in chunks cut off tile edges, and one chunk batched with
    another prompt: every row the same bits (tasks of different row groups, tile runs starting
    mid-tile, different task sizes for load balance)."""
    heads, kv_heads, n = (12, 2, 3000) if head_dim < 256 else (4, 1, 3000)
    q, k, v, meta = setup([n], [n], heads, kv_heads, head_dim, seed=7)
    table = meta.block_tables
    whole = kernel(q, k, v, meta, 0.1, window)

    def chunk_meta(q_len, ctx):
        return AttentionMetadata(
            torch.zeros(q_len, dtype=torch.long), [0], [q_len], [ctx], table, null_block=k.shape[0] - 1
        )

    for cuts in ([0, 1000, 2048, 3000], [0, 7, 1031, 1032, 2999, 3000]):
        parts = [
            kernel(q[a:b].contiguous(), k, v, chunk_meta(b - a, b), 0.1, window) for a, b in itertools.pairwise(cuts)
        ]
        assert torch.equal(torch.cat(parts), whole), cuts
    # rows 1500..2999 beside a short prompt whose keys come first in the cache
    other = torch.randn(40, heads, head_dim, generator=torch.Generator().manual_seed(8))
    both = AttentionMetadata(
        torch.zeros(1540, dtype=torch.long),
        [0, 40],
        [40, 1500],
        [40, n],
        [table[0][:3], table[0]],
        null_block=k.shape[0] - 1,
    )
    batched = kernel(torch.cat([other, q[1500:]]), k, v, both, 0.1, window)
    assert torch.equal(batched[40:], whole[1500:])
