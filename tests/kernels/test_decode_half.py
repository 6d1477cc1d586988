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
