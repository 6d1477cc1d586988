"""The 16-row panel layout of int8/int4 weights and its kernels (AVX-512 VNNI, or AVX2)."""

from __future__ import annotations

import pytest
import torch

from tokenloom.quant import QuantizedLinear, WeightFormat, quantize_int4, quantize_int8
from tokenloom.quant.int8 import kernels, panels
from tokenloom.quant.int8.modules import QuantizedEmbedding

needs_panels = pytest.mark.skipif(not kernels.panels_available(), reason="no panel kernels built here")
FORMATS = ["int8", "int8-g32", "int4-g32", "int4-g64", "int4-g128"]


def quantized(fmt: str, n: int, k: int, seed: int = 0):
    torch.manual_seed(seed)
    f = WeightFormat.parse(fmt)
    w = torch.randn(n, k) * 0.05
    w[:, :32] = torch.where(torch.rand(n, 32) < 0.5, -1.0, 1.0)  # a block at the code extremes
    return quantize_int8(w, f.group_size) if f.bits == 8 else quantize_int4(w, f.group_size)


@pytest.mark.parametrize("fmt", FORMATS)
def test_panels_hold_the_same_codes_and_convert_back_exactly(fmt):
    q = quantized(fmt, 48, 256)
    p = panels.to_panels(q)
    assert p.data.numel() == q.data.numel() and p.scales.shape == (3, q.scales.shape[1], 16)
    if q.bits == 4:  # panel 1, block 2, chunk 3, row 16+5: byte i = codes k | k+4 << 4, k = 64 + 24 + i
        codes = panels._codes(q)
        for i in range(4):
            assert p.data[1, 2, 3, 4 * 5 + i] == codes[21, 88 + i] | (codes[21, 92 + i] << 4)
    else:  # byte i of chunk 3 = code of k = 64 + 12 + i, plus 128
        for i in range(4):
            assert int(p.data[1, 2, 3, 4 * 5 + i]) == int(q.data[21, 76 + i]) + 128
    back = panels.from_panels(p)
    assert torch.equal(back.data, q.data) and torch.equal(back.scales, q.scales)
    assert (q.offsets is None) == (back.offsets is None) and (q.offsets is None or torch.equal(back.offsets, q.offsets))
    ids = torch.tensor([0, 47, 21, 16, 21])
    picked = panels.rows(p, ids)
    assert torch.equal(picked.dequantize(), q.rows(ids).dequantize())


@needs_panels
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("rows", [1, 3, 17])
def test_panel_kernel_matches_the_row_kernel_and_the_dequantized_matmul(fmt, rows):
    """Both kernels quantize activations the same way; only the float sums' order differs."""
    q = quantized(fmt, 96, 384, seed=rows)
    torch.manual_seed(rows)
    x, bias = torch.randn(rows, 384) * 4, torch.randn(96)
    got = kernels.bind(panels.to_panels(q), bias, True)(x)
    row_kernel = kernels.bind(q, bias, False)(x)
    torch.testing.assert_close(got, row_kernel, rtol=1e-5, atol=1e-4)
    want = x @ q.dequantize().T + bias
    assert ((got - want).norm() / want.norm()).item() < (0.01 if q.bits == 8 else 0.03)


@needs_panels
@pytest.mark.parametrize("fmt", ["int8", "int4-g32"])
def test_panel_kernel_rows_do_not_depend_on_their_batch(fmt):
    p = panels.to_panels(quantized(fmt, 208, 576))  # 13 panels: 2-panel passes and a leftover
    x = torch.randn(6, 576)
    whole = kernels.bind(p, None, True)(x)
    assert all(torch.equal(whole[i : i + 1], kernels.bind(p, None, True)(x[i : i + 1].contiguous())) for i in range(6))


@needs_panels
@pytest.mark.parametrize("fmt", ["int8", "int4-g32"])
@pytest.mark.parametrize("rows", [1, 3])
def test_gate_up_with_silu_in_the_call_is_the_same_bits_as_the_ops_one_by_one(fmt, rows):
    """The int8/int4 panel call with silu(gate) * up after it against the product, then fused.silu_mul;
    the layer takes that path (pairs_gate_up) once re-laid as panels."""
    from tokenloom.layers import fused

    assert fused.build()
    q = quantized(fmt, 96, 256, seed=rows)  # 6 panels: gate 3, up 3
    torch.manual_seed(rows)
    x, bias = torch.randn(rows, 256), torch.randn(96)
    product = kernels.bind(panels.to_panels(q), bias, True)(x)
    gated = kernels.bind(panels.to_panels(q), bias, True, silu_mul=True)(x)
    assert gated.shape == (rows, 48) and torch.equal(gated, fused.silu_mul(product))
    layer = QuantizedLinear(256, 96, True, WeightFormat.parse(fmt))
    layer.load_weight(q.dequantize())
    layer.bias.copy_(bias)
    assert not layer.pairs_gate_up  # the row layout has no such call
    layer.use_panels()
    assert layer.pairs_gate_up and torch.equal(layer.silu_mul(x), fused.silu_mul(layer(x)))
    half = x.bfloat16()  # computed in float32, returned in x's dtype
    assert torch.equal(layer.silu_mul(half), layer.silu_mul(half.float()).bfloat16())


@needs_panels
def test_a_re_laid_layer_saves_and_embeds_in_the_row_layout():
    torch.manual_seed(0)
    layer = QuantizedLinear(256, 64, False, WeightFormat.parse("int4"))
    layer.load_weight(torch.randn(64, 256) * 0.05)
    before = {k: v.clone() for k, v in layer.state_dict().items()}
    x = torch.randn(5, 256)
    y_rows = layer(x)
    embedding = QuantizedEmbedding(layer, torch.float32)
    ids = torch.tensor([[3, 63], [17, 3]])
    e_rows = embedding(ids)
    assert layer.use_panels() and layer.qweight.shape == (4, 8, 4, 64)
    after = layer.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)
    torch.testing.assert_close(layer(x), y_rows, rtol=1e-5, atol=1e-5)
    assert torch.equal(embedding(ids), e_rows)
    with pytest.raises(RuntimeError, match="before use_panels"):
        layer.load_weight(torch.randn(64, 256))


@pytest.mark.skipif(not kernels.available(), reason="no compiled int8/int4 kernels here")
@pytest.mark.parametrize("fmt", FORMATS)
def test_the_native_row_lookup_dequantizes_as_the_torch_one(fmt):
    """kernels.panel_rows (an embedding's lookup) against panels.rows(...).dequantize(): same bits;
    an out-of-range id is an error naming it."""
    q = quantized(fmt, 64, 384, seed=4)
    q.scales.mul_(torch.where(torch.rand_like(q.scales) < 0.5, 1.0, 4.0))  # varied, still on the float16 grid
    p = panels.to_panels(q)
    ids = torch.tensor([0, 63, 21, 16, 21, 40])
    assert torch.equal(kernels.panel_rows(p, ids), panels.rows(p, ids).dequantize())
    with pytest.raises(RuntimeError, match="index 64 is out of range for 64 rows"):
        kernels.panel_rows(p, torch.tensor([3, 64]))


@pytest.mark.parametrize("fmt", FORMATS)
def test_quantize_puts_scales_and_offsets_on_the_float16_grid(fmt):
    """What lets the panel layout hold them in float16 without changing a weight."""
    q = quantized(fmt, 32, 256)
    assert torch.equal(q.scales.half().float(), q.scales)
    assert q.offsets is None or torch.equal(q.offsets.half().float(), q.offsets)
    assert panels.fits(q) and panels.to_panels(q).scales.dtype == torch.float16


@needs_panels
def test_a_layer_whose_scales_float16_cannot_hold_keeps_the_row_layout():
    q = quantized("int4-g32", 32, 256)
    q.scales = q.scales * (1 + 1e-6)  # off the float16 grid: float16 would change them
    layer = QuantizedLinear(256, 32, False, WeightFormat.parse("int4"))
    layer.load_weight(q)
    assert not panels.fits(q) and not layer.use_panels()
    x = torch.randn(3, 256)
    torch.testing.assert_close(layer(x), x @ q.dequantize().T, rtol=0.03, atol=0.05)


@needs_panels
def test_an_int8_weight_with_code_minus_128_keeps_the_row_layout():
    """-128 is a valid int8 code but not one the AVX2 panel kernel's sign trick holds (its negation
    overflows): such a weight stays in the row layout and still multiplies exactly."""
    q = quantized("int8-g32", 32, 256)
    assert panels.fits(q)
    q.data[5, 7] = -128
    layer = QuantizedLinear(256, 32, False, WeightFormat.parse("int8-g32"))
    layer.load_weight(q)
    assert not panels.fits(q) and not layer.use_panels()
    x = torch.randn(3, 256)
    x[:, 7] = -3.0  # the -128 code meets a negative activation
    want = x @ q.dequantize().T
    assert ((layer(x) - want).norm() / want.norm()).item() < 0.01
