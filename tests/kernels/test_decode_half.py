"""The CPU decode kernel over a 16-bit KV cache (paged_decode_half: float16 or bfloat16 elements read
in place) against attention in float64 over the same cache as HalfCache itself reads it."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.test_decode_int8 import BS, assert_matches, attend, paged, reference
from tokenloom.attention import cpu_decode
from tokenloom.kernels import native
from tokenloom.kv_cache.quantized import HALF_DTYPES, HalfCache

pytestmark = pytest.mark.skipif(not native.cpu_has_avx2(), reason="the kernel needs AVX2 + FMA")

EDGES = [1, 7, 8, 9, BS - 1, BS, BS + 1, 31, 32, 33, 3 * BS, 5 * BS + 7, 1000]  # blocks and 8/16-wide tiles


def half_cache(num_blocks: int, kv_heads: int, head_dim: int, storage: str, gen: torch.Generator) -> HalfCache:
    """A HalfCache of random rows of varied magnitude, the null block zero."""
    zeros = lambda size, dtype: torch.zeros(size, dtype=dtype)  # noqa: E731
    cache = HalfCache.allocate((num_blocks + 1, BS, kv_heads, head_dim), HALF_DTYPES[storage], torch.float32, zeros)
    x = torch.randn(num_blocks * BS, kv_heads, head_dim, generator=gen)
    cache.store(torch.arange(num_blocks * BS), x * torch.exp(torch.randn(num_blocks * BS, kv_heads, 1, generator=gen)))
    return cache


def paged_half(lens: list[int], heads: int, kv_heads: int, head_dim: int, seed: int = 0, storage: str = "float16"):
    """Key and value caches, each sequence's blocks scattered, one query per sequence."""
    return paged(lambda n, gen: half_cache(n, kv_heads, head_dim, storage, gen), lens, heads, head_dim, seed)


@pytest.mark.parametrize("storage", sorted(HALF_DTYPES))
@pytest.mark.parametrize("head_dim", [12, 32, 64, 80, 128, 256])  # 12: scalar lanes; 80: a column tail of 16 lanes
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (14, 2), (4, 1)])  # 1, 7 and 4 heads a kv head
def test_half_kernel_equals_the_widened_cache(kernel_build, storage, head_dim, heads, kv_heads):
    k, v, tables, q = paged_half(EDGES, heads, kv_heads, head_dim, seed=head_dim + heads, storage=storage)
    assert cpu_decode.usable(q, k)
    got = attend(q, k, v, EDGES, tables, head_dim**-0.5)
    assert got.shape == q.shape and got.dtype == torch.float32
    assert_matches(got, reference(q, k, v, EDGES, tables, head_dim**-0.5))


@pytest.mark.parametrize("storage", sorted(HALF_DTYPES))
@pytest.mark.parametrize(
    "window,softcap,sinks", [(7, None, False), (40, 5.0, False), (None, 5.0, True), (9, None, True)]
)
def test_half_kernel_windows_caps_and_sinks(kernel_build, storage, window, softcap, sinks):
    k, v, tables, q = paged_half(EDGES, 8, 2, 64, seed=3, storage=storage)
    q *= 4  # scores large enough for a cap to bend them
    sink = 2 * torch.randn(8, generator=torch.Generator().manual_seed(1)) if sinks else None
    got = attend(q, k, v, EDGES, tables, 0.125, window, softcap, sink)
    assert_matches(got, reference(q, k, v, EDGES, tables, 0.125, window, softcap, sink))
    assert not torch.allclose(got, attend(q, k, v, EDGES, tables, 0.125), atol=1e-3)  # each option changed something


@pytest.mark.parametrize("storage", sorted(HALF_DTYPES))
def test_one_attended_position_reads_its_value_exactly_widened(kernel_build, storage):
    """A context of one: the softmax weight is exactly 1, so the output is the stored value widened
    to float32 bit for bit (a 16-bit value is a float32 exactly)."""
    k, v, tables, q = paged_half([1, 1], 8, 2, 64, seed=9, storage=storage)
    got = attend(q, k, v, [1, 1], tables, 0.125)
    for b in range(2):
        stored = v.data[tables[b][0], 0].float().repeat_interleave(4, 0)  # (heads, head_dim)
        assert torch.equal(got[b], stored)


@pytest.mark.parametrize("storage", sorted(HALF_DTYPES))
def test_half_kernel_reads_nothing_past_a_context(kernel_build, storage):
    """Every slot past each sequence's end (the rest of its last block, the blocks after) holds NaN:
    the outputs stay finite and equal to those over a clean cache."""
    lens = [5, 17, 40]
    k, v, tables, q = paged_half(lens, 4, 2, 32, seed=2, storage=storage)
    clean = attend(q, k, v, lens, tables, 0.2)
    used = {(int(t[p // BS]), p % BS) for n, t in zip(lens, tables) for p in range(n)}
    for cache in (k, v):
        for block in range(cache.data.shape[0]):
            for offset in range(BS):
                if (block, offset) not in used:
                    cache.data[block, offset] = float("nan")
    got = attend(q, k, v, lens, tables, 0.2)
    assert torch.isfinite(got).all() and torch.equal(got, clean)


def test_the_half_op_refuses_mixed_storage(kernel_build):
    k, v, tables, q = paged_half([4], 2, 2, 32)
    bf = v.data.to(torch.bfloat16)
    ctx = torch.tensor([4])
    table = torch.stack(tables)
    with pytest.raises(RuntimeError, match="both float16 or both bfloat16"):
        cpu_decode.ops().paged_decode_half(q, k.data, bf, table, ctx, 1.0, 0, 0.0)


@pytest.mark.parametrize("storage", sorted(HALF_DTYPES))
@pytest.mark.parametrize("heads,kv_heads,head_dim,rotary_dim", [(6, 2, 32, 32), (9, 3, 64, 64), (4, 2, 64, 48)])
def test_the_fused_decode_block_rounds_what_it_writes_as_halfcache_does(
    kernel_build, storage, heads, kv_heads, head_dim, rotary_dim
):
    """rope_write_decode_half (one call) against the op-by-op path: the fused rope in float32,
    HalfCache.store (torch's rounding to 16 bits, ties to even), the decode kernel. The same bits
    for the written keys and values and for the output."""
    from tokenloom.attention.metadata import AttentionMetadata
    from tokenloom.layers import fused
    from tokenloom.layers.rope import apply_rope, rope_cos_sin

    lens = [5, 40, 17]
    k, v, tables, _ = paged_half(lens, heads, kv_heads, head_dim, seed=4, storage=storage)
    gen = torch.Generator().manual_seed(5)
    qkv = torch.randn(len(lens), (heads + 2 * kv_heads) * head_dim, generator=gen) * 3
    tie = 1 + (2**-11 if storage == "float16" else 2**-8)  # halfway between 1 and the next 16-bit value
    qkv[0, (heads + kv_heads) * head_dim] = tie  # sequence 0's first value element (values are not rotated)
    positions = torch.tensor(lens) - 1
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim))
    cos, sin = rope_cos_sin(inv_freq, positions, torch.float32)
    slots = torch.stack([tables[i][(n - 1) // BS] * BS + (n - 1) % BS for i, n in enumerate(lens)])
    k_ref, v_ref = (HalfCache(c.data.clone(), c.scales.clone(), c.dtype) for c in (k, v))
    assert fused.build()
    qk = apply_rope(qkv[:, : (heads + kv_heads) * head_dim].view(len(lens), -1, head_dim), cos, sin)
    k_ref.store(slots, qk[:, heads:])
    v_ref.store(slots, qkv[:, (heads + kv_heads) * head_dim :].view(len(lens), kv_heads, head_dim))
    meta = AttentionMetadata(slots, [0, 1, 2], [1, 1, 1], lens, tables, null_block=k.data.shape[0] - 1)
    want = cpu_decode.attend(qk[:, :heads].contiguous(), k_ref, v_ref, meta, [0, 1, 2], 0.3)
    tables_padded, ctx = cpu_decode.decode_inputs(meta)
    got = cpu_decode.ops().rope_write_decode_half(
        qkv, cos, sin, k.data, v.data, slots, tables_padded, ctx, heads, 0.3, 0, 0.0
    )
    assert torch.equal(k.data, k_ref.data) and torch.equal(v.data, v_ref.data)
    assert v.data.view(-1, kv_heads, head_dim)[slots[0], 0, 0].item() == 1.0  # the tie went to the even side
    assert torch.equal(got, want.reshape(len(lens), -1))
