"""The CPU prompt-attention kernel over stored-format caches (16-bit, int8 and int4 blocks, widened
to float32 as each key tile is copied): the same bits as the kernel over the cache layer's own
dequantized float32 copy, around tile and block edges, with windows and soft-capped scores, on
every build this CPU runs; and a prompt chunk's rope and cache write (rope_write_stored) storing
exactly what the layer's ``store`` does."""

from __future__ import annotations

import pytest
import torch

from tests.attention.test_prefill_long import kernel, setup
from tokenloom.attention import cpu_decode, cpu_prefill
from tokenloom.kv_cache.quantized import QuantizedKV, allocate_stored

pytestmark = pytest.mark.skipif(cpu_prefill.ops() is None, reason="the kernel needs an AVX2 CPU and a compiler")

FORMATS = ["float16", "bfloat16", "int8", "int4"]


def empty_layer(kind: str, shape: tuple[int, ...]) -> QuantizedKV:
    """A zeroed cache layer of `kind` and logical `shape` (blocks, block_size, kv_heads, head_dim),
    read as float32."""
    return allocate_stored(kind, shape, torch.float32, lambda size, dtype: torch.zeros(size, dtype=dtype))


def stored(kind: str, cache: torch.Tensor) -> QuantizedKV:
    """`cache` (blocks, block_size, kv_heads, head_dim) float32, rows of varied magnitude, stored
    in `kind` by the layer's own ``store``."""
    layer = empty_layer(kind, tuple(cache.shape))
    rows = cache.flatten(0, 1)
    layer.store(torch.arange(rows.shape[0]), rows)
    return layer


def dequantized(layer: QuantizedKV) -> torch.Tensor:
    """The layer's every block as its own reads give them, float32 (blocks, block_size, kv_heads, head_dim)."""
    return layer[torch.arange(layer.shape[0])].contiguous()


CASES = [  # (query lengths, context lengths, heads, kv heads, head_dim): tile (16-128 keys) and block edges
    ([15, 17, 33], [15, 17, 33], 4, 2, 32),
    ([2, 64, 9], [32, 64, 65], 6, 1, 64),
    ([127, 40], [127, 300], 4, 4, 128),
    ([16, 5], [31, 81], 2, 1, 256),
]


@pytest.mark.parametrize("kind", FORMATS)
@pytest.mark.parametrize("q_lens,ctx_lens,heads,kv_heads,head_dim", CASES)
def test_stored_blocks_give_the_bits_of_their_dequantized_copy(
    prefill_build, kind, q_lens, ctx_lens, heads, kv_heads, head_dim
):
    q, k, v, meta = setup(q_lens, ctx_lens, heads, kv_heads, head_dim, seed=head_dim + heads)
    k_layer, v_layer = stored(kind, k), stored(kind, v)
    assert cpu_prefill.usable(q, k_layer)
    got = kernel(q, k_layer, v_layer, meta, head_dim**-0.5)
    want = kernel(q, dequantized(k_layer), dequantized(v_layer), meta, head_dim**-0.5)
    assert torch.isfinite(got).all() and torch.equal(got, want)
    assert not torch.equal(want, kernel(q, k, v, meta, head_dim**-0.5))  # the stored values, not the originals


@pytest.mark.parametrize("kind", FORMATS)
@pytest.mark.parametrize("window,softcap", [(20, None), (None, 5.0), (40, 5.0)])
def test_windows_and_soft_caps_over_stored_blocks(prefill_build, kind, window, softcap):
    q, k, v, meta = setup([50, 7], [120, 90], 4, 2, 64, seed=3)
    k_layer, v_layer = stored(kind, k), stored(kind, v)
    got = kernel(q, k_layer, v_layer, meta, 0.125, window, softcap)
    want = kernel(q, dequantized(k_layer), dequantized(v_layer), meta, 0.125, window, softcap)
    assert torch.equal(got, want)


def test_the_kernel_takes_stored_layers_read_as_float32_only():
    shape = (3, 16, 2, 64)
    for kind in FORMATS:
        layer = empty_layer(kind, shape)
        assert cpu_prefill.takes(64, layer)
        layer.dtype = torch.bfloat16  # read in the model's bfloat16: the torch path's
        assert not cpu_prefill.takes(64, layer)


def test_int8_blocks_without_their_scales_are_refused():
    q, k, v, meta = setup([4], [4], 2, 2, 32)
    layer = stored("int8", k)
    tables, starts, lens, ctx = cpu_prefill._inputs(meta, [0])
    with pytest.raises(RuntimeError, match="need their scales"):
        cpu_prefill.ops().paged_prefill(q, layer.data, layer.data, tables, starts, lens, ctx, 0.1, 0, 0.0, q.clone())


@pytest.mark.parametrize("kind", FORMATS)
@pytest.mark.parametrize("heads,kv_heads,head_dim,rotary_dim", [(6, 2, 32, 32), (4, 2, 64, 48)])
def test_a_prompt_chunks_rope_and_write_store_what_the_layer_does(kind, heads, kv_heads, head_dim, rotary_dim):
    """rope_write_stored over 150 rows (split over the threads) in scattered slots: the rotated
    queries equal the fused rope's, and every written code and scale equals the layer's own
    ``store`` of the rotated keys and the values."""
    from tokenloom.layers import fused
    from tokenloom.layers.rope import apply_rope, rope_cos_sin

    if not cpu_decode.build():
        pytest.skip("the decode kernel library (which holds rope_write_stored) is not built here")
    T, blocks = 150, 12
    gen = torch.Generator().manual_seed(7)
    qkv = torch.randn(T, (heads + 2 * kv_heads) * head_dim, generator=gen) * torch.exp(torch.randn(T, 1, generator=gen))
    slots = torch.randperm(blocks * 16, generator=gen)[:T]
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim))
    cos, sin = rope_cos_sin(inv_freq, torch.arange(T), torch.float32)
    shape = (blocks + 1, 16, kv_heads, head_dim)
    k, v, k_ref, v_ref = (empty_layer(kind, shape) for _ in range(4))
    assert fused.build()
    qk = apply_rope(qkv[:, : (heads + kv_heads) * head_dim].view(T, -1, head_dim), cos, sin)
    k_ref.store(slots, qk[:, heads:])
    v_ref.store(slots, qkv[:, (heads + kv_heads) * head_dim :].view(T, kv_heads, head_dim))
    k_data, v_data, k_scales, v_scales = cpu_prefill.cache_arrays(k, v)
    q = cpu_decode.ops().rope_write_stored(qkv, cos, sin, k_data, v_data, slots, heads, k_scales, v_scales)
    assert torch.equal(q, qk[:, :heads])
    assert torch.equal(k.data, k_ref.data) and torch.equal(v.data, v_ref.data)
    assert torch.equal(k.scales, k_ref.scales) and torch.equal(v.scales, v_ref.scales)
