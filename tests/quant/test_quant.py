"""Weight-only int8/int4: formats, the CPU kernels, quantized layers, GGUF blocks, saved folders."""

from __future__ import annotations

import pytest
import torch

from tokenloom.kernels import native
from tokenloom.quant import QuantizedLinear, WeightFormat, quantize_int4, quantize_int8
from tokenloom.quant.int8 import kernels
from tokenloom.quant.int8.formats import pack_int4, unpack_int4

needs_kernels = pytest.mark.skipif(not native.cpu_has_avx2(), reason="the kernels need AVX2 + FMA")


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def test_int4_packing_is_ggufs_block_layout():
    q = torch.randint(0, 16, (3, 64), dtype=torch.uint8)
    packed = pack_int4(q)
    assert packed.shape == (3, 32)
    # GGUF Q4_0/Q4_1: in each block of 32, byte j = value j | value j+16 << 4
    for block in range(2):
        for j in range(16):
            assert packed[1, block * 16 + j] == q[1, block * 32 + j] | (q[1, block * 32 + j + 16] << 4)
    assert torch.equal(unpack_int4(packed), q)


@pytest.mark.parametrize("bits,group", [(8, None), (8, 32), (4, 32), (4, 64), (4, 128)])
def test_rounding_error_is_at_most_half_a_step(bits, group):
    w = torch.randn(16, 256) * 0.05
    q = quantize_int8(w, group) if bits == 8 else quantize_int4(w, group)
    step = q.scales.repeat_interleave(q.group_size, dim=1)  # (N, K) scale of each element
    assert ((w - q.dequantize()).abs() <= step / 2 + 1e-6).all()
    codes = q.data.float() if bits == 8 else unpack_int4(q.data).float()
    assert codes.min() >= (-127 if bits == 8 else 0) and codes.max() <= (127 if bits == 8 else 15)


@needs_kernels
def test_kernels_build_on_an_avx2_cpu():
    assert kernels.available(), "the int8/int4 kernels must compile here (see the log for the compiler error)"


@needs_kernels
@pytest.mark.parametrize("fmt", ["int8", "int8-g32", "int4-g32", "int4-g64", "int4-g128"])
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 33])
def test_kernel_matches_the_dequantized_matmul(fmt, rows):
    """The kernel quantizes activations per block of 32 (int8): that is its only extra error."""
    torch.manual_seed(rows)
    f = WeightFormat.parse(fmt)
    w, bias, x = torch.randn(72, 256) * 0.05, torch.randn(72), torch.randn(rows, 256)
    q = quantize_int8(w, f.group_size) if f.bits == 8 else quantize_int4(w, f.group_size)
    got = kernels.bind(q, bias, False)(x)
    want = x @ q.dequantize().T + bias
    assert rel_err(got, want) < (0.01 if f.bits == 8 else 0.03)  # measured: 0.5% / 1-2%


@needs_kernels
@pytest.mark.parametrize("bits", [8, 4])
def test_kernel_rows_do_not_depend_on_their_batch(bits):
    torch.manual_seed(1)
    w, x = torch.randn(200, 576) * 0.05, torch.randn(7, 576)
    q = quantize_int8(w) if bits == 8 else quantize_int4(w)
    run = kernels.bind(q, None, False)
    whole = run(x)
    assert all(torch.equal(whole[i : i + 1], run(x[i : i + 1].contiguous())) for i in range(7))


@needs_kernels
@pytest.mark.skipif(not native.cpu_has_avx512_vnni(), reason="no AVX-512 VNNI on this CPU")
@pytest.mark.parametrize("bits", [8, 4])
def test_vnni_build_gives_the_avx2_builds_bits(bits):
    """Both builds sum each block exactly in int32; extreme codes (+-127, 15) included."""
    assert native.load(kernels._SOURCE, "int8/int4 CPU kernels") and kernels._ops() is torch.ops.tokenloom_quant_vnni
    torch.manual_seed(2)
    w, x = torch.randn(96, 320) * 0.05, torch.randn(9, 320) * 4
    w[:, :32] = torch.where(torch.rand(96, 32) < 0.5, -1.0, 1.0)  # whole blocks at the code extremes
    x[:, :32] = torch.where(torch.rand(9, 32) < 0.5, -8.0, 8.0)
    q = quantize_int8(w) if bits == 8 else quantize_int4(w)
    for ops in (torch.ops.tokenloom_quant, torch.ops.tokenloom_quant_vnni):
        got = (
            ops.linear_int8(x, q.data, q.scales, q.group_size, None)
            if bits == 8
            else ops.linear_int4(x, q.data, q.scales, q.offsets, q.group_size, None)
        )
        if ops is torch.ops.tokenloom_quant:
            avx2 = got
    assert torch.equal(got, avx2)


def reference_activation_codes(x: torch.Tensor):
    """int8 codes per block of 32 as documented (int8_dot.h): scale max|x|/127 (NaN ignored), codes
    round-half-even(x / scale) with a NaN product (NaN or inf input) coded 0; codes, scales, code sums."""
    blocks = x.view(x.shape[0], -1, 32)
    amax = torch.where(blocks.isnan(), 0.0, blocks.abs()).amax(-1)
    scales = amax / 127
    inv = torch.where(scales > 0, 1 / scales, torch.zeros_like(scales))
    product = blocks * inv[..., None]
    codes = torch.where(product.isnan(), 0.0, torch.round(product)).to(torch.int8)
    return codes.view_as(x), scales, codes.to(torch.int32).sum(-1)


@needs_kernels
def test_activation_codes_match_the_reference_in_every_build():
    """Ties (x.5 at scale 1) round to even, zero blocks get scale 0, a NaN or inf codes as 0: the
    vectorized quantization (AVX2 and AVX-512 builds) against the arithmetic it claims."""
    assert native.load(kernels._SOURCE, "int8/int4 CPU kernels") and kernels._ops() is not None  # AVX2, fastest
    torch.manual_seed(3)
    x = torch.randn(4, 160) * 4
    x[:, 32:64] = torch.arange(32) - 15.5  # halves: ties at scale ...
    x[:, 32] = 127.0  # ... exactly 1
    x[:, 64:96] = 0.0
    x[1, 100], x[2, 130] = float("nan"), float("inf")
    x[3, 96:128] = torch.randn(32) * 1e-30  # tiny (subnormal-adjacent) scales
    want = reference_activation_codes(x)
    builds = [torch.ops.tokenloom_quant] + ([torch.ops.tokenloom_quant_vnni] if native.cpu_has_avx512_vnni() else [])
    for ops in builds:
        got = ops.quantize_rows(x)
        for g, w, what in zip(got, want, ("codes", "scales", "code sums")):
            assert torch.equal(g, w), f"{ops}: {what} differ from the reference"
    assert (want[0][:, 33:64] % 2 == 0).all() and want[0][0, 33] == -14  # ties went to even


# Relative error of a quantized layer vs the float layer on random inputs, as documented
# in docs/QUANTIZATION.md (measured on Gaussian weights: 0.9%, 7.9%, 9.0%, 10.1%).
STATED_ERROR = {"int8": 0.02, "int4-g32": 0.10, "int4-g64": 0.12, "int4-g128": 0.14}


@pytest.mark.parametrize("fmt", list(STATED_ERROR))
def test_quantized_linear_stays_within_its_stated_error(fmt):
    torch.manual_seed(0)
    linear = torch.nn.Linear(512, 384)
    torch.nn.init.normal_(linear.weight, std=0.02)
    layer = QuantizedLinear(512, 384, True, WeightFormat.parse(fmt))
    layer.load_weight(linear.weight.detach())
    layer.bias.data.copy_(linear.bias.detach())
    x = torch.randn(4, 7, 512)
    with torch.no_grad():
        got, want = layer(x), linear(x)
    assert got.shape == want.shape == (4, 7, 384)
    err = rel_err(got - linear.bias, want - linear.bias)
    assert err < STATED_ERROR[fmt]
    assert err > 1e-4  # really quantized


def test_a_reloaded_bfloat16_bias_reaches_the_kernel():
    """The layer binds its kernel (with a float32 copy of the bias) on the first forward;
    loading a state dict must not leave that copy behind."""
    torch.manual_seed(0)
    layer = QuantizedLinear(256, 32, True, WeightFormat.parse("int8"), dtype=torch.bfloat16)
    layer.load_weight(torch.randn(32, 256) * 0.02)
    layer.bias.data.zero_()
    x = torch.randn(2, 256, dtype=torch.bfloat16)
    before = layer(x)
    state = layer.state_dict()
    state["bias"] = torch.full((32,), 3.0, dtype=torch.bfloat16)
    layer.load_state_dict(state)
    torch.testing.assert_close(layer(x).float(), before.float() + 3.0, rtol=0.02, atol=0.02)
