"""The CPU decode kernel over an int8 KV cache (paged_decode_int8: codes and scales read in
place) against attention in float64 over the same cache dequantized by Int8Cache itself."""

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
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-n // BS) for n in lens) + 3
    k, v = int8_cache(num_blocks, kv_heads, head_dim, gen), int8_cache(num_blocks, kv_heads, head_dim, gen)
    return k, v, scattered_tables(lens, num_blocks, gen), torch.randn(len(lens), heads, head_dim, generator=gen)


def scattered_tables(lens: list[int], num_blocks: int, gen: torch.Generator) -> list[torch.Tensor]:
    """Each sequence's block table: its blocks taken in turn from a random order of the cache's
    `num_blocks`, so no two sequences share one and none lies next to the one before."""
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables, used = [], 0
    for n in lens:
        tables.append(torch.tensor(order[used : used + -(-n // BS)]))
        used += len(tables[-1])
    return tables


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


EDGES = [1, BS - 1, BS, BS + 1, 3 * BS, 5 * BS + 7, 1000]  # around block edges, several blocks, long


@pytest.mark.parametrize("head_dim", [20, 32, 64, 80, 128, 256])  # 20: scalar lanes; 80: a column tail
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2), (14, 2), (4, 1)])  # 1, 4, 7 and 4 heads a kv head
def test_int8_kernel_equals_the_dequantized_cache(kernel_build, head_dim, heads, kv_heads):
    k, v, tables, q = paged_int8(EDGES, heads, kv_heads, head_dim, seed=head_dim + heads)
    assert cpu_decode.usable(q, k)
    got = attend(q, k, v, EDGES, tables, head_dim**-0.5)
    assert got.shape == q.shape and got.dtype == torch.float32
    assert_matches(got, reference(q, k, v, EDGES, tables, head_dim**-0.5))


@pytest.mark.parametrize("window", [1, 7, 16, 40, 5000])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_int8_kernel_attends_to_the_last_window_positions(kernel_build, window, head_dim):
    k, v, tables, q = paged_int8(EDGES, 6, 2, head_dim, seed=window)
    got = attend(q, k, v, EDGES, tables, 0.1, window)
    assert_matches(got, reference(q, k, v, EDGES, tables, 0.1, window))


@pytest.mark.parametrize("window", [None, 20])
@pytest.mark.parametrize("head_dim", [64, 256])
def test_int8_kernel_soft_caps_scores(kernel_build, window, head_dim):
    k, v, tables, q = paged_int8(EDGES, 8, 2, head_dim, seed=5)
    q *= 4  # scores large enough for the cap to bend them
    got = attend(q, k, v, EDGES, tables, head_dim**-0.5, window, softcap=5.0)
    assert_matches(got, reference(q, k, v, EDGES, tables, head_dim**-0.5, window, softcap=5.0))
    plain = attend(q, k, v, EDGES, tables, head_dim**-0.5, window)
    assert not torch.allclose(got, plain, atol=1e-3)  # the cap changed something


@pytest.mark.parametrize("window", [None, 9])
@pytest.mark.parametrize("head_dim", [32, 64, 20])
def test_int8_kernel_counts_each_heads_sink(kernel_build, window, head_dim):
    k, v, tables, q = paged_int8(EDGES, 4, 2, head_dim, seed=11)
    sinks = 2 * torch.randn(4, generator=torch.Generator().manual_seed(1))
    got = attend(q, k, v, EDGES, tables, 0.3, window, sinks=sinks)
    assert_matches(got, reference(q, k, v, EDGES, tables, 0.3, window, sinks=sinks))
    plain = attend(q, k, v, EDGES, tables, 0.3, window)
    assert not torch.allclose(got, plain, atol=1e-3)


def test_a_sequence_gets_the_same_bits_alone_batched_and_on_any_thread_count(kernel_build):
    """Each head's arithmetic does not depend on the task it runs in: a sequence alone, among
    others, split over 1 or 2 threads (by kv head, or by share of a kv head's query heads)."""
    lens = [5, 200, 33, 1000]
    for heads, kv_heads in [(8, 2), (4, 1)]:
        k, v, tables, q = paged_int8(lens, heads, kv_heads, 64, seed=heads)
        before = torch.get_num_threads()
        try:
            results = []
            for threads in (1, 2):
                torch.set_num_threads(threads)
                batched = attend(q, k, v, lens, tables, 0.125, softcap=20.0)
                for i in range(len(lens)):
                    alone = attend(q[i : i + 1], k, v, lens[i : i + 1], tables[i : i + 1], 0.125, softcap=20.0)
                    assert torch.equal(batched[i : i + 1], alone)
                results.append(batched)
        finally:
            torch.set_num_threads(before)
        assert torch.equal(results[0], results[1])


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


def test_the_kernel_takes_an_int8_cache_read_as_float32_only(kernel_build):
    k, *_ = paged_int8([4], 2, 2, 32)
    q = torch.randn(1, 2, 32)
    assert cpu_decode.usable(q, k)
    assert not cpu_decode.usable(q.bfloat16(), k)
    assert not cpu_decode.usable(q, Int8Cache(k.data, k.scales, torch.bfloat16))
