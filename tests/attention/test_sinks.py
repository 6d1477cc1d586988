"""Attention sinks (gpt-oss): each head's softmax runs over its scores and one learned logit with no
value behind it, whose share is dropped. The decode kernel and the torch path (per sequence, through
the log-sum-exp) against float64 arithmetic written from transformers' eager formula."""

from __future__ import annotations

import pytest
import torch

from tests.attention.test_attention import NUM_BLOCKS, paged_setup
from tokenloom.attention import backend, cpu_decode, torch_sdpa
from tokenloom.attention.metadata import AttentionMetadata
from tokenloom.kernels import native


def paged(lens: list[int], heads: int, kv_heads: int, head_dim: int, rows: int, seed: int = 0):
    """test_attention's scattered random caches, and `rows` random queries large enough that the
    scores spread (the sinks' share then differs from head to head)."""
    k, v, tables, _ = paged_setup(lens, heads, kv_heads, seed, head_dim)
    gen = torch.Generator().manual_seed(seed + 100)
    return k, v, tables, 3 * torch.randn(rows, heads, head_dim, generator=gen) / head_dim**0.5


def reference(q, k, v, lens, q_lens, tables, scale, sinks, window=None) -> torch.Tensor:
    """Float64: per query row, softmax over [scores of the positions it sees, its head's sink], the
    sink column dropped, times the values (transformers' GptOss eager_attention_forward)."""
    out = torch.empty(q.shape, dtype=torch.float64)
    group, row = q.shape[1] // k.shape[2], 0
    for n, q_len, table in zip(lens, q_lens, tables):
        keys = k[table].reshape(-1, *k.shape[2:])[:n].double().repeat_interleave(group, 1)  # (n, heads, d)
        vals = v[table].reshape(-1, *v.shape[2:])[:n].double().repeat_interleave(group, 1)
        for p in range(n - q_len, n):
            first = 0 if window is None else max(0, p + 1 - window)
            scores = torch.einsum("hd,khd->hk", q[row].double(), keys[first : p + 1]) * scale
            weights = torch.cat([scores, sinks.double()[:, None]], dim=1).softmax(-1)[:, :-1]
            out[row] = torch.einsum("hk,khd->hd", weights, vals[first : p + 1])
            row += 1
    return out


def meta_of(lens, q_lens, tables) -> AttentionMetadata:
    starts = [sum(q_lens[:i]) for i in range(len(q_lens))]
    return AttentionMetadata(
        torch.zeros(sum(q_lens), dtype=torch.long), starts, list(q_lens), list(lens), tables, null_block=NUM_BLOCKS
    )


def new_keys(cache, lens, q_lens, tables) -> torch.Tensor:
    """The step's own keys (or values) as the torch path is handed them: each sequence's last q_len."""
    rows = [cache[t].reshape(-1, *cache.shape[2:])[n - q : n] for n, q, t in zip(lens, q_lens, tables)]
    return torch.cat(rows)


@pytest.mark.skipif(not native.cpu_has_avx2(), reason="the kernel needs AVX2 + FMA")
@pytest.mark.parametrize("build", cpu_decode.BUILDS, ids=[isa for isa, _ in cpu_decode.BUILDS])
@pytest.mark.parametrize("head_dim,heads,kv_heads", [(64, 8, 2), (32, 6, 2), (20, 3, 3)])  # 16-lane, 8-lane, scalar
@pytest.mark.parametrize("window", [None, 20])
def test_the_decode_kernel_counts_each_heads_sink(monkeypatch, build, head_dim, heads, kv_heads, window):
    monkeypatch.setattr(cpu_decode, "BUILDS", (build,))
    if not cpu_decode.build():
        pytest.skip(f"the {build[0]} build of the kernel does not run here")
    lens = [1, 17, 150, 45]  # 150: one sequence shared by the threads when alone
    k, v, tables, q = paged(lens, heads, kv_heads, head_dim, len(lens), seed=1)
    sinks = 2 * torch.randn(heads, generator=torch.Generator().manual_seed(2))
    scale = head_dim**-0.5
    got = cpu_decode.attend(q, k, v, meta_of(lens, [1] * 4, tables), list(range(4)), scale, window, sinks=sinks)
    want = reference(q, k, v, lens, [1] * 4, tables, scale, sinks, window)
    torch.testing.assert_close(got.double(), want, atol=5e-6, rtol=1e-5)
    alone = cpu_decode.attend(q[2:3], k, v, meta_of(lens[2:3], [1], tables[2:3]), [0], scale, window, sinks=sinks)
    assert torch.equal(alone[0], got[2])
    plain = cpu_decode.attend(q, k, v, meta_of(lens, [1] * 4, tables), list(range(4)), scale, window)
    assert (got - plain).abs().max() > 0.05  # the sinks took a share


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (3, 3)])
def test_the_torch_path_counts_each_heads_sink_for_prompts_and_decodes(window, heads, kv_heads):
    """A whole prompt, a chunk after cached positions and a decoding row in one step."""
    lens, q_lens = [9, 30, 12], [9, 7, 1]
    k, v, tables, q = paged(lens, heads, kv_heads, 16, sum(q_lens), seed=3)
    sinks = 2 * torch.randn(heads, generator=torch.Generator().manual_seed(4))
    meta = meta_of(lens, q_lens, tables)
    k_new, v_new = new_keys(k, lens, q_lens, tables), new_keys(v, lens, q_lens, tables)
    got = torch_sdpa.paged_attention(q, k_new, v_new, k, v, meta, 0.25, window, sinks=sinks)
    want = reference(q, k, v, lens, q_lens, tables, 0.25, sinks, window)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


def test_plans_with_sinks_keep_prompts_off_the_prefill_kernel():
    """The prefill kernel has no sinks: a step with a prompt chunk never plans the kernel backend
    for such a model, while an all-decode step may."""
    k, v, tables, _ = paged([9, 12], 4, 2, 32, 1)
    cache = type("Cache", (), {"keys": {0: k}, "values": {0: v}, "layers": [0]})()
    shape = backend.AttentionShape(4, 2, 32, 0.2, sinks=True)
    rope = (torch.ones(10, 1, 32), torch.zeros(10, 1, 32))
    assert not backend.kernels_take(shape, meta_of([9, 12], [9, 1], tables), cache, rope)
    decoding = backend.kernels_take(shape, meta_of([9, 12], [1, 1], tables), cache, (rope[0][:2], rope[1][:2]))
    assert decoding == cpu_decode.usable(rope[0], k)
