"""The CPU paged decode kernel against torch's SDPA over gathered blocks (the reference path)."""

from __future__ import annotations

import pytest
import torch

from tokenloom.attention import backend, cpu_decode, torch_sdpa
from tokenloom.attention.metadata import AttentionMetadata
from tokenloom.kernels import native

pytestmark = pytest.mark.skipif(not native.cpu_has_avx2(), reason="the kernel needs AVX2 + FMA")

NUM_BLOCKS, BS, D = 64, 16, 32


@pytest.fixture(autouse=True, params=cpu_decode.BUILDS, ids=[isa for isa, _ in cpu_decode.BUILDS])
def kernel_build(request, monkeypatch):
    """Every test runs against each build of the kernel this CPU runs (AVX-512, AVX2)."""
    monkeypatch.setattr(cpu_decode, "BUILDS", (request.param,))
    if not cpu_decode.build():
        pytest.skip(f"the {request.param[0]} build of the kernel does not run here")
    return request.param


def paged_setup(lens: list[int], heads: int, kv_heads: int, seed: int = 0, head_dim: int = D):
    """Random caches (null block zero), each sequence's blocks scattered, one query per sequence."""
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(NUM_BLOCKS + 1, BS, kv_heads, head_dim, generator=gen)
    v = torch.randn(NUM_BLOCKS + 1, BS, kv_heads, head_dim, generator=gen)
    k[NUM_BLOCKS] = v[NUM_BLOCKS] = 0
    order = torch.randperm(NUM_BLOCKS, generator=gen).tolist()
    tables, used = [], 0
    for n in lens:
        tables.append(torch.tensor(order[used : used + -(-n // BS)]))
        used += len(tables[-1])
    return k, v, tables, torch.randn(len(lens), heads, head_dim, generator=gen)


def decode_meta(lens, tables) -> AttentionMetadata:
    return AttentionMetadata(
        torch.zeros(len(lens), dtype=torch.long),
        list(range(len(lens))),
        [1] * len(lens),
        list(lens),
        tables,
        null_block=NUM_BLOCKS,
    )


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (6, 2), (9, 3)])
@pytest.mark.parametrize("window", [None, 20])
def test_kernel_equals_sdpa_over_gathered_blocks(heads, kv_heads, window):
    lens = [1, 16, 17, 150, 45]
    k, v, tables, q = paged_setup(lens, heads, kv_heads)
    assert cpu_decode.usable(q, k)
    got = cpu_decode.attend(q, k, v, decode_meta(lens, tables), list(range(len(lens))), 0.2, window)
    want = torch_sdpa._decode_batch(q, k, v, decode_meta(lens, tables), 0.2, heads != kv_heads, window)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("head_dim", [20, 64, 80, 128, 256])  # 20: the scalar path; 80: a 16-column tail
@pytest.mark.parametrize("heads,kv_heads", [(5, 5), (8, 2), (10, 2), (14, 2)])  # 1, 4, 5, 7 heads per kv head
def test_kernel_handles_head_sizes_and_group_sizes(head_dim, heads, kv_heads):
    lens = [3, 31, 64, 129]
    k, v, tables, q = paged_setup(lens, heads, kv_heads, seed=3, head_dim=head_dim)
    got = cpu_decode.attend(q, k, v, decode_meta(lens, tables), list(range(len(lens))), head_dim**-0.5)
    want = torch_sdpa._decode_batch(q, k, v, decode_meta(lens, tables), head_dim**-0.5, heads != kv_heads)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def capped_reference(q, k, v, lens, tables, scale, softcap, window=None) -> torch.Tensor:
    """Float64 soft-capped attention of each sequence's one query over its gathered context."""
    out = torch.empty(q.shape, dtype=torch.float64)
    group = q.shape[1] // k.shape[2]
    for i, (n, table) in enumerate(zip(lens, tables)):
        first = 0 if window is None else max(0, n - window)
        keys = k[table].reshape(-1, *k.shape[2:])[first:n].double().repeat_interleave(group, 1)  # (n, heads, d)
        vals = v[table].reshape(-1, *v.shape[2:])[first:n].double().repeat_interleave(group, 1)
        scores = torch.tanh(torch.einsum("hd,khd->hk", q[i].double(), keys) * scale / softcap) * softcap
        out[i] = torch.einsum("hk,khd->hd", scores.softmax(-1), vals)
    return out


@pytest.mark.parametrize("head_dim,heads,kv_heads", [(64, 8, 2), (256, 4, 1), (20, 3, 3)])  # AVX-512, wide, scalar
@pytest.mark.parametrize("window", [None, 20])
def test_soft_capped_scores_equal_float64_attention(head_dim, heads, kv_heads, window):
    """Gemma 2's tanh soft-cap: raw scores reach well past the cap, where capping changes the weights."""
    lens = [1, 17, 150, 45]
    k, v, tables, q = paged_setup(lens, heads, kv_heads, seed=6, head_dim=head_dim)
    q = 40 * q / head_dim**0.5
    got = cpu_decode.attend(q, k, v, decode_meta(lens, tables), list(range(len(lens))), 0.5, window, softcap=5.0)
    want = capped_reference(q, k, v, lens, tables, 0.5, 5.0, window)
    torch.testing.assert_close(got.double(), want, atol=5e-6, rtol=1e-5)
    uncapped = torch_sdpa._decode_batch(q, k, v, decode_meta(lens, tables), 0.5, heads != kv_heads, window)
    assert (got - uncapped).abs().max() > 0.1


def test_a_sequence_gets_the_same_bits_alone_or_batched():
    lens = [90, 33, 200]
    k, v, tables, q = paged_setup(lens, 6, 2)
    batched = cpu_decode.attend(q, k, v, decode_meta(lens, tables), [0, 1, 2], 0.2)
    alone = cpu_decode.attend(q[1:2], k, v, decode_meta(lens[1:2], tables[1:2]), [0], 0.2)
    assert torch.equal(batched[1], alone[0])


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("head_dim,heads,kv_heads", [(64, 9, 3), (32, 6, 2), (128, 4, 1), (256, 2, 2)])
@pytest.mark.parametrize("window,softcap", [(None, None), (100, None), (None, 5.0)])
def test_a_long_sequence_shared_by_the_threads_gets_the_bits_it_gets_in_a_batch(
    two_threads, head_dim, heads, kv_heads, window, softcap
):
    """With fewer sequences than threads, a sequence of 64+ attended positions is shared by every
    thread (positions, then heads, then columns: decode_all); in a batch of as many sequences as
    threads it is one thread's. Same bits either way, and the reference's values."""
    lens = [150, 64, 300, 17]
    k, v, tables, q = paged_setup(lens, heads, kv_heads, seed=7, head_dim=head_dim)
    scale = head_dim**-0.5
    batched = cpu_decode.attend(q, k, v, decode_meta(lens, tables), list(range(4)), scale, window, softcap=softcap)
    for i in range(4):
        alone = cpu_decode.attend(
            q[i : i + 1], k, v, decode_meta(lens[i : i + 1], tables[i : i + 1]), [0], scale, window, softcap=softcap
        )
        assert torch.equal(alone[0], batched[i]), f"sequence {i} ({lens[i]} positions)"
    if softcap is None:
        want = torch_sdpa._decode_batch(q, k, v, decode_meta(lens, tables), scale, heads != kv_heads, window)
    else:
        want = capped_reference(q, k, v, lens, tables, scale, softcap).float()
    torch.testing.assert_close(batched, want, atol=1e-5, rtol=1e-5)


def test_decoding_rows_beside_a_prefill_chunk_use_the_kernel_and_match_the_reference(monkeypatch):
    """A step mixing a 5-token prefill chunk with two decoding sequences: same output with
    the kernel as with SDPA everywhere (the kernel turned off)."""
    heads, kv_heads, lens, q_lens = 6, 2, [40, 5, 70], [1, 5, 1]
    k, v, tables, _ = paged_setup(lens, heads, kv_heads, seed=1)
    gen = torch.Generator().manual_seed(2)
    T = sum(q_lens)
    q, kn, vn = (torch.randn(T, h, D, generator=gen) for h in (heads, kv_heads, kv_heads))
    starts = [0, 1, 6]
    slots = (
        [tables[0][39 // BS] * BS + 39 % BS]
        + [tables[1][0] * BS + p for p in range(5)]
        + [tables[2][69 // BS] * BS + 69 % BS]
    )

    def run():
        meta = AttentionMetadata(torch.tensor(slots), starts, q_lens, lens, tables, null_block=NUM_BLOCKS)
        return backend.paged_attention(q, kn, vn, k.clone(), v.clone(), meta, 0.2)

    with_kernel = run()
    monkeypatch.setattr(cpu_decode, "usable", lambda q, cache: False)
    torch.testing.assert_close(with_kernel, run(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "heads,kv_heads,head_dim,rotary_dim",
    [(6, 2, 32, 32), (9, 3, 64, 64), (4, 4, 80, 80), (6, 2, 64, 48), (4, 2, 32, 8)],
)
def test_the_fused_decode_block_equals_rope_then_cache_write_then_attention(heads, kv_heads, head_dim, rotary_dim):
    """rope_write_decode (one call) against the op-by-op path: the fused rope, index_copy into
    the cache, the decode kernel. Same bits for the cached keys/values and the output; with
    partial rotary (rotary_dim < head_dim) the unturned dims pass through."""
    from tokenloom.layers import fused
    from tokenloom.layers.rope import apply_rope, rope_cos_sin

    lens = [5, 40, 17]
    k_cache, v_cache, tables, _ = paged_setup(lens, heads, kv_heads, seed=4, head_dim=head_dim)
    gen = torch.Generator().manual_seed(5)
    qkv = torch.randn(len(lens), (heads + 2 * kv_heads) * head_dim, generator=gen)
    positions = torch.tensor(lens) - 1
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim))
    cos, sin = rope_cos_sin(inv_freq, positions, torch.float32)
    slots = torch.stack([tables[i][(n - 1) // BS] * BS + (n - 1) % BS for i, n in enumerate(lens)])
    meta = decode_meta(lens, tables)
    meta.slot_mapping = slots
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    assert fused.build()
    qk = apply_rope(qkv[:, : (heads + kv_heads) * head_dim].view(len(lens), -1, head_dim), cos, sin)
    v_rows = qkv[:, (heads + kv_heads) * head_dim :].view(len(lens), kv_heads, head_dim)
    torch_sdpa.write_kv(k_ref, v_ref, qk[:, heads:], v_rows, slots)
    want = cpu_decode.attend(qk[:, :heads], k_ref, v_ref, decode_meta(lens, tables), [0, 1, 2], 0.3)
    tables_padded, ctx = cpu_decode.decode_inputs(meta)
    got = cpu_decode.ops().rope_write_decode(
        qkv, cos, sin, k_cache, v_cache, slots, tables_padded, ctx, heads, 0.3, 0, 0.0
    )
    assert got.shape == (len(lens), heads * head_dim)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)
    assert torch.equal(got, want.reshape(len(lens), -1))
    slot_rows = k_cache.view(-1, kv_heads, head_dim)[slots]  # the written keys' unturned dims
    k_in = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(len(lens), kv_heads, head_dim)
    assert torch.equal(slot_rows[..., rotary_dim:], k_in[..., rotary_dim:])
    if rotary_dim < head_dim:  # against rope on the turned dims alone
        turned = apply_rope(k_in[..., :rotary_dim].contiguous(), cos, sin)
        torch.testing.assert_close(slot_rows[..., :rotary_dim], turned)
