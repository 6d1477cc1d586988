"""The CPU prompt-chunk attention kernel (cpu_prefill) against float64 attention over the
gathered blocks, and the bit-for-bit invariances it promises."""

from __future__ import annotations

import itertools

import pytest
import torch

from tokenloom.attention import backend, cpu_prefill
from tokenloom.attention.metadata import AttentionMetadata

pytestmark = [
    pytest.mark.skipif(cpu_prefill.ops() is None, reason="the kernel needs an AVX2 CPU and a compiler"),
    pytest.mark.usefixtures("prefill_build"),  # every test on each build this CPU runs (AVX-512, AVX2)
]

NUM_BLOCKS, BS = 96, 16


def caches(kv_heads: int, head_dim: int, seed: int = 0):
    """Random key and value caches (the null block, last, zero)."""
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(NUM_BLOCKS + 1, BS, kv_heads, head_dim, generator=gen)
    v = torch.randn(NUM_BLOCKS + 1, BS, kv_heads, head_dim, generator=gen)
    k[NUM_BLOCKS] = v[NUM_BLOCKS] = 0
    return k, v


def scattered_tables(ctx_lens: list[int], seed: int = 0) -> list[torch.Tensor]:
    order = torch.randperm(NUM_BLOCKS, generator=torch.Generator().manual_seed(seed)).tolist()
    tables, used = [], 0
    for n in ctx_lens:
        tables.append(torch.tensor(order[used : used + -(-n // BS)]))
        used += len(tables[-1])
    return tables


def meta_for(q_lens, ctx_lens, tables) -> AttentionMetadata:
    starts = [sum(q_lens[:i]) for i in range(len(q_lens))]
    return AttentionMetadata(
        torch.zeros(sum(q_lens), dtype=torch.long), starts, list(q_lens), list(ctx_lens), tables, null_block=NUM_BLOCKS
    )


def kernel(q, k, v, meta, scale, window=None, softcap=None) -> torch.Tensor:
    out = torch.full_like(q, float("nan"))
    cpu_prefill.attend_into(out, q, k, v, meta, list(range(meta.num_seqs)), scale, window, softcap)
    return out


def reference(q, k, v, meta, scale, window=None, softcap=None) -> torch.Tensor:
    """Float64 causal attention of each sequence's rows over its gathered context (scores
    soft-capped, tanh(s / softcap) * softcap, where softcap is given)."""
    out = torch.empty(q.shape, dtype=torch.float64)
    group = q.shape[1] // k.shape[2]
    for start, q_len, ctx, table in zip(meta.query_start, meta.query_lens, meta.context_lens, meta.block_tables):
        keys = k[table].reshape(-1, *k.shape[2:])[:ctx].double().repeat_interleave(group, 1)  # (ctx, heads, d)
        vals = v[table].reshape(-1, *v.shape[2:])[:ctx].double().repeat_interleave(group, 1)
        scores = torch.einsum("qhd,khd->hqk", q[start : start + q_len].double(), keys) * scale
        if softcap:
            scores = torch.tanh(scores / softcap) * softcap
        q_pos, k_pos = torch.arange(ctx - q_len, ctx)[:, None], torch.arange(ctx)[None, :]
        allowed = k_pos <= q_pos
        if window:
            allowed &= k_pos > q_pos - window
        weights = scores.masked_fill(~allowed, -torch.inf).softmax(-1)
        out[start : start + q_len] = torch.einsum("hqk,khd->qhd", weights, vals)
    return out


@pytest.mark.parametrize(
    "heads,kv_heads,head_dim", [(4, 4, 32), (9, 3, 64), (8, 2, 128), (6, 1, 64), (10, 2, 32), (7, 1, 32), (4, 1, 256)]
)
@pytest.mark.parametrize("window", [None, 20, 40])
def test_kernel_equals_float64_attention(heads, kv_heads, head_dim, window):
    # whole prompts (q_len == ctx), chunks after cached context, lengths around the 16-row tiles;
    # 1-7 query heads per kv head (passes of 3, 2 and 1 heads); windows that leave every key
    # tile masked (20) or some tiles wholly inside it (40: the unmasked path)
    q_lens, ctx_lens = [2, 16, 17, 150, 5, 40, 34], [2, 16, 17, 150, 45, 200, 80]
    k, v = caches(kv_heads, head_dim)
    meta = meta_for(q_lens, ctx_lens, scattered_tables(ctx_lens))
    q = torch.randn(sum(q_lens), heads, head_dim, generator=torch.Generator().manual_seed(1))
    got = kernel(q, k, v, meta, head_dim**-0.5, window)
    torch.testing.assert_close(got.double(), reference(q, k, v, meta, head_dim**-0.5, window), atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("window", [None, 20])
def test_soft_capped_scores_equal_float64_attention(window):
    """Gemma 2's tanh soft-cap inside the kernel: queries scaled up so raw scores reach well past
    the cap (where capping changes the weights), against capped float64 attention."""
    q_lens, ctx_lens = [2, 17, 40, 5], [2, 17, 200, 45]
    k, v = caches(2, 64, seed=13)
    meta = meta_for(q_lens, ctx_lens, scattered_tables(ctx_lens))
    q = 6 * torch.randn(sum(q_lens), 6, 64, generator=torch.Generator().manual_seed(14))
    got = kernel(q, k, v, meta, 0.125, window, softcap=5.0)
    torch.testing.assert_close(got.double(), reference(q, k, v, meta, 0.125, window, softcap=5.0), atol=5e-6, rtol=1e-5)
    uncapped = reference(q, k, v, meta, 0.125, window)
    assert (got.double() - uncapped).abs().max() > 0.1  # the cap matters at these scores


def test_only_the_listed_sequences_rows_are_written():
    k, v = caches(2, 64)
    q_lens, ctx_lens = [3, 1, 20], [3, 30, 20]
    meta = meta_for(q_lens, ctx_lens, scattered_tables(ctx_lens))
    q = torch.randn(24, 6, 64)
    out = torch.full_like(q, 7.0)
    cpu_prefill.attend_into(out, q, k, v, meta, [0, 2], 0.125)
    assert torch.all(out[3] == 7.0)  # the decoding sequence's row: untouched
    assert not torch.any(out[:3] == 7.0) and not torch.any(out[4:] == 7.0)


def test_a_prompt_gets_the_same_bits_whole_chunked_or_row_by_row():
    """Keys/values already in the cache (as after each chunk's write): every split of a
    190-token prompt into chunks yields the same bits as one whole call."""
    heads, kv_heads, d, n = 9, 3, 64, 190
    k, v = caches(kv_heads, d, seed=4)
    table = scattered_tables([n], seed=5)
    q = torch.randn(n, heads, d, generator=torch.Generator().manual_seed(6))
    whole = kernel(q, k, v, meta_for([n], [n], table), 0.125)
    for cuts in ([0, 7, 64, 65, 190], [0, 100, 190], list(range(0, 191, 19))):
        parts = [
            kernel(q[a:b].contiguous(), k, v, meta_for([b - a], [b], table), 0.125) for a, b in itertools.pairwise(cuts)
        ]
        assert torch.equal(torch.cat(parts), whole), cuts
    rows = [kernel(q[t : t + 1].contiguous(), k, v, meta_for([1], [t + 1], table), 0.125) for t in range(0, n, 37)]
    assert torch.equal(torch.cat(rows), whole[0:n:37])


def test_a_prompt_gets_the_same_bits_alone_or_batched():
    k, v = caches(2, 64, seed=7)
    q_lens, ctx_lens = [33, 90, 4], [33, 120, 4]
    tables = scattered_tables(ctx_lens, seed=8)
    q = torch.randn(sum(q_lens), 8, 64, generator=torch.Generator().manual_seed(9))
    batched = kernel(q, k, v, meta_for(q_lens, ctx_lens, tables), 0.2)
    alone = kernel(q[33:123].contiguous(), k, v, meta_for([90], [120], tables[1:2]), 0.2)
    assert torch.equal(batched[33:123], alone)


def test_paged_attention_sends_long_contexts_and_decode_rows_elsewhere(monkeypatch):
    """A step with a short prompt, a decoding sequence and a prompt chunk past MAX_CONTEXT:
    the kernel takes only the short prompt, and the step matches the reference throughout."""
    monkeypatch.setattr(cpu_prefill, "MAX_CONTEXT", 64)
    heads, kv_heads, d = 6, 2, 64
    q_lens, ctx_lens = [20, 1, 30], [20, 50, 100]
    k, v = caches(kv_heads, d, seed=10)
    tables = scattered_tables(ctx_lens, seed=11)
    meta = meta_for(q_lens, ctx_lens, tables)
    assert cpu_prefill.prefill_rows(meta) == [0]
    gen = torch.Generator().manual_seed(12)
    q, kn, vn = (torch.randn(sum(q_lens), h, d, generator=gen) for h in (heads, kv_heads, kv_heads))
    slots = torch.tensor(
        [int(t[p // BS]) * BS + p % BS for t, n, c in zip(tables, q_lens, ctx_lens) for p in range(c - n, c)]
    )
    meta.slot_mapping = slots
    kc, vc = k.clone(), v.clone()
    got = backend.paged_attention(q, kn, vn, kc, vc, meta, d**-0.5)
    torch.testing.assert_close(
        got.double(), reference(q, kc, vc, meta_for(q_lens, ctx_lens, tables), d**-0.5), atol=2e-6, rtol=1e-5
    )


def test_bad_inputs_are_refused():
    k, v = caches(2, 64)
    q = torch.randn(10, 4, 64)
    meta = meta_for([10], [10], scattered_tables([10]))
    tables, starts, lens, ctx = cpu_prefill._inputs(meta, [0])
    with pytest.raises(RuntimeError, match="out of range"):
        cpu_prefill.ops().paged_prefill(
            q, k, v, tables, starts, lens, torch.tensor([900]), 0.1, 0, 0.0, torch.empty_like(q)
        )
    with pytest.raises(RuntimeError, match="block id out of range"):
        cpu_prefill.ops().paged_prefill(
            q, k, v, torch.full_like(tables, 5000), starts, lens, ctx, 0.1, 0, 0.0, torch.empty_like(q)
        )


def test_every_build_takes_every_head_size_at_every_context():
    """Both builds take heads of 32-256 and prompt chunks at any context (cpu_prefill's module doc):
    a 1,024-row chunk after 31,744 cached positions included; decode rows go elsewhere."""
    for d in cpu_prefill.HEAD_DIMS:
        assert cpu_prefill.takes(d, torch.zeros(2, BS, 1, d))
    assert not cpu_prefill.takes(96, torch.zeros(2, BS, 1, 96))
    assert cpu_prefill.MAX_CONTEXT is None
    meta = meta_for([5000, 1, 2, 1024], [8192, 30, 2, 32768], scattered_tables([16, 16, 2, 16]))
    assert cpu_prefill.prefill_rows(meta) == [0, 2, 3]
