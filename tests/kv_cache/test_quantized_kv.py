"""The int4 KV cache against llama.cpp's q4_0 written out element by element, its error bound,
its footprint, and the head sizes it refuses; the 16-bit caches' rounding and footprint; every
stored format read alike whole and in chunks."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.kv_cache.test_kv_cache import small_config
from tokenloom.kv_cache.paged import PagedKVCache, kv_bytes_per_token
from tokenloom.kv_cache.quantized import HALF_DTYPES, HalfCache, Int4Cache, allocate_stored


def q4_0_reference(x: np.ndarray) -> np.ndarray:
    """llama.cpp's quantize_row_q4_0 then dequantize_row_q4_0, one group of 32 at a time (float32,
    the scale rounded to float16 as the block stores it)."""
    out = np.empty_like(x, dtype=np.float32)
    for g in range(0, x.size, 32):
        group = x[g : g + 32].astype(np.float32)
        m = group[np.argmax(np.abs(group))]
        d = np.float32(np.float16(m / np.float32(-8.0)))
        inv = np.float32(1.0) / d if d != 0 else np.float32(0.0)
        for j, v in enumerate(group):
            q = min(15, int(np.float32(v * inv + np.float32(8.5))))
            out[g + j] = np.float32(q - 8) * d
    return out


def _cache(head_dim: int, heads: int = 2) -> Int4Cache:
    return Int4Cache.allocate(
        (5, 4, heads, head_dim), torch.float32, lambda size, dtype: torch.zeros(size, dtype=dtype)
    )


def test_int4_round_trip_is_llama_cpps_q4_0():
    gen = torch.Generator().manual_seed(0)
    cache = _cache(64)
    x = torch.randn(7, 2, 64, generator=gen) * torch.tensor([0.01, 30.0])[None, :, None]  # two head scales
    x[3, 1, :32] = 0.0  # an all-zero group reads back as zeros
    slots = torch.tensor([0, 5, 6, 11, 12, 13, 19])
    cache.store(slots, x)
    got = cache[torch.arange(5)].reshape(20, 2, 64)[slots]
    want = torch.from_numpy(np.stack([q4_0_reference(row) for row in x.reshape(-1, 64).numpy()]).reshape(7, 2, 64))
    assert torch.equal(got, want)
    scale = x.reshape(7, 2, 2, 32).abs().amax(-1, keepdim=True).expand(-1, -1, -1, 32).reshape(7, 2, 64)
    assert torch.all((got - x).abs() <= scale / 8 * 1.002)  # at most one step of d = max / 8
    untouched = torch.ones(20, dtype=torch.bool)
    untouched[slots] = False
    assert torch.all(cache[torch.arange(5)].reshape(20, 2, 64)[untouched] == 0)


def test_int4_footprint_is_18_bytes_per_32_elements():
    cfg = small_config(head_dim=64)  # 2 layers, 1 kv head
    per_token = kv_bytes_per_token(cfg, torch.bfloat16, "int4")
    assert per_token == 2 * 2 * 1 * (32 + 2 * 2)  # K and V x layers x kv heads x (codes + two float16 scales)
    assert per_token <= 0.29 * kv_bytes_per_token(cfg, torch.bfloat16)
    kv = PagedKVCache(cfg, num_blocks=6, block_size=4, dtype=torch.float32, device="cpu", kv_cache_dtype="int4")
    stored = sum(c.data.nbytes + c.scales.nbytes for c in kv.keys + kv.values)
    assert stored == per_token * (kv.num_blocks + 1) * kv.block_size


def test_a_stored_layer_of_an_unknown_format_is_refused_by_name():
    with pytest.raises(ValueError, match="not a stored KV cache format: 'fp8'"):
        allocate_stored("fp8", (2, 4, 1, 32), torch.float32, lambda size, dtype: torch.zeros(size, dtype=dtype))


def test_int4_refuses_a_head_size_its_groups_do_not_divide():
    with pytest.raises(ValueError, match="int4 KV cache needs head_dim a multiple of 32, got 48"):
        PagedKVCache(
            small_config(48), num_blocks=2, block_size=4, dtype=torch.float32, device="cpu", kv_cache_dtype="int4"
        )


@pytest.mark.parametrize("storage", sorted(HALF_DTYPES))
def test_a_half_cache_stores_each_element_rounded_to_16_bits_and_reads_it_widened(storage):
    """Written float32 rows come back as torch's own round-to-nearest to the 16-bit type, widened
    exactly; slots not written stay zero; block copies and clears move the elements."""
    zeros = lambda size, dtype: torch.zeros(size, dtype=dtype)  # noqa: E731
    cache = HalfCache.allocate((5, 4, 2, 8), HALF_DTYPES[storage], torch.float32, zeros)
    x = torch.randn(6, 2, 8) * 100
    slots = torch.tensor([0, 1, 2, 3, 9, 13])
    cache.store(slots, x)
    read = cache[torch.arange(5)].reshape(20, 2, 8)
    assert read.dtype == torch.float32
    assert torch.equal(read[slots], x.to(HALF_DTYPES[storage]).float())
    assert not torch.equal(read[slots], x)  # rounded: 16 bits hold fewer than float32's
    assert read[[4, 5, 6, 7, 8]].abs().sum() == 0
    cache.copy_blocks_(torch.tensor([0]), torch.tensor([4]))
    assert torch.equal(cache[torch.tensor([4])], cache[torch.tensor([0])])
    cache.index_fill_(0, torch.tensor([0]), 0.0)
    assert cache[torch.tensor([0])].abs().sum() == 0


@pytest.mark.parametrize("storage", sorted(HALF_DTYPES))
def test_a_half_cache_takes_two_bytes_an_element_whatever_the_compute_dtype(storage):
    cfg = small_config(head_dim=64)  # 2 layers, 1 kv head
    per_token = kv_bytes_per_token(cfg, torch.float32, storage)
    assert per_token == 2 * 2 * 1 * 64 * 2 == kv_bytes_per_token(cfg, torch.float32) // 2
    kv = PagedKVCache(cfg, num_blocks=6, block_size=4, dtype=torch.float32, device="cpu", kv_cache_dtype=storage)
    assert all(c.data.dtype == HALF_DTYPES[storage] for c in kv.keys + kv.values)
    stored = sum(c.data.nbytes + c.scales.nbytes for c in kv.keys + kv.values)
    assert stored == per_token * (kv.num_blocks + 1) * kv.block_size


@pytest.mark.parametrize(
    "kv_cache_dtype,min_same,max_kl",
    [("int8", 0.98, 3e-3), ("int4", 0.85, 0.25), ("float16", 0.99, 1e-3), ("bfloat16", 0.98, 3e-3)],
)
def test_a_quantized_cache_reads_alike_whole_and_in_chunks(default_model_dir, kv_cache_dtype, min_same, max_kl):
    """Every chunk attends to the keys and values as the cache stores them (quantized), whether the
    prompt is prefilled whole or in chunks of 16 (partial blocks and block edges included). Not to
    the bit: a key computed in a batch of another shape differs in its last bits, which can move it
    across a rounding boundary, a whole step (an eighth of its group's largest value in int4), and
    the layers after it carry that on: the bounds are those of the quantization itself (int4 against
    float32 keys: same top-1 ~0.9, KL ~0.2 on this text); a chunk that read wrong keys is far off."""
    import torch

    from tokenloom import LLM
    from tokenloom.eval.agreement import compare_logits
    from tokenloom.eval.scoring import default_eval_text

    llm = LLM(str(default_model_dir), kv_cache_dtype=kv_cache_dtype, kv_cache_memory=16 << 20)
    ids = llm.tokenizer.encode(default_eval_text())[:203]
    whole = torch.cat([logits for _, logits in llm.engine.prefill_logits(ids, chunk_size=len(ids))])
    chunked = torch.cat([logits for _, logits in llm.engine.prefill_logits(ids, chunk_size=16)])
    same, kl = compare_logits(whole, chunked)
    assert same.float().mean() >= min_same and kl.mean() <= max_kl
