"""GGUF blocks kept as stored: every block type's kernels against the `gguf` package's own
dequantization, on both instruction-set builds, and the exact re-layouts against the same."""

from __future__ import annotations

import itertools

import gguf
import numpy as np
import pytest
import torch

from tokenloom.kernels import native
from tokenloom.quant.gguf import blocks as gguf_blocks
from tokenloom.quant.gguf import panels as gguf_panels
from tokenloom.quant.gguf import tensor as ggml
from tokenloom.quant.gguf.tensor import KERNEL_TYPES, GGMLTensor
from tokenloom.quant.int8.kernels import panels_available as ggml_panels_available

# byte offsets of each type's float16 fields (random bytes there could be inf/nan)
HALF_FIELDS = {
    "Q4_0": [0],
    "Q4_1": [0, 2],
    "Q5_0": [0],
    "Q5_1": [0, 2],
    "Q8_0": [0],
    "IQ4_NL": [0],
    "Q2_K": [80, 82],
    "Q3_K": [108],
    "Q4_K": [0, 2],
    "Q5_K": [0, 2],
    "Q6_K": [208],
    "IQ4_XS": [0],
    "MXFP4": [],  # its scale is a power-of-two exponent byte (random_blocks)
}
TYPES = sorted(KERNEL_TYPES)


def random_blocks(kind: int, rows: int, k: int, seed: int = 0) -> np.ndarray:
    """(rows, bytes) of random blocks of GGML type `kind`, with finite scales."""
    name, values, nbytes = KERNEL_TYPES[kind]
    rng = np.random.default_rng(seed + kind)
    raw = rng.integers(0, 256, size=(rows, k // values, nbytes), dtype=np.uint8)
    for at in HALF_FIELDS[name]:
        halves = rng.uniform(-0.05, 0.05, size=(rows, k // values)).astype(np.float16)
        raw[:, :, at : at + 2] = halves.view(np.uint8).reshape(rows, k // values, 2)
    if name == "Q8_0":  # codes -127..127, as llama.cpp writes them (-128: panels.fits)
        codes = raw[:, :, 2:]
        codes[codes == 0x80] = 0x81
    if name == "MXFP4":  # e8m0 scales 2^(e - 127) of weight-like size, and the subnormal ends 0 and 1
        raw[:, :, 0] = rng.integers(118, 130, size=(rows, k // values))
        raw[0, :3, 0] = [0, 1, 2]
    return raw.reshape(rows, -1)


def reference(kind: int, raw: np.ndarray, k: int) -> torch.Tensor:
    array = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(kind))
    return torch.from_numpy(np.ascontiguousarray(array, dtype=np.float32)).view(raw.shape[0], k)


def grid_activations(m: int, k: int) -> torch.Tensor:
    """x whose int8 quantization per 32 values is exact (codes -127..127, power-of-two scales, each
    block holding a +-127), so kernel and float products differ only in summation order."""
    g = torch.Generator().manual_seed(m * k)
    codes = torch.randint(-127, 128, (m, k // 32, 32), generator=g)
    codes[:, :, 0] = 127
    scales = 2.0 ** torch.randint(-8, 0, (m, k // 32, 1), generator=g)
    return (codes * scales).view(m, k).float()


def builds() -> list[tuple[str, object]]:
    """(isa, torch.ops namespace) for every build of the GGML kernels this CPU runs."""
    found = []
    for isa, library in ggml._BUILDS:
        if native.load(ggml._SOURCE, "GGUF block kernels", isa):
            found.append((isa, getattr(torch.ops, library)))
    return found


@pytest.fixture(scope="module", params=["avx512vnni", "avx2"])
def kernel_ops(request):
    match = [ops for isa, ops in builds() if isa == request.param]
    if not match:
        pytest.skip(f"no {request.param} build on this CPU")
    return match[0]


@pytest.mark.parametrize("kind", TYPES, ids=[KERNEL_TYPES[t][0] for t in TYPES])
def test_dequantize_matches_gguf_exactly(kernel_ops, kind):
    k = 512
    raw = random_blocks(kind, 8, k)
    got = kernel_ops.dequantize(torch.from_numpy(raw), kind, k)
    assert torch.equal(got, reference(kind, raw, k))


@pytest.mark.parametrize("kind", TYPES, ids=[KERNEL_TYPES[t][0] for t in TYPES])
@pytest.mark.parametrize("m", [1, 3])
def test_matmul_matches_dequantized_product(kernel_ops, kind, m):
    k, n = 512, 37
    raw = random_blocks(kind, n, k, seed=m)
    x = grid_activations(m, k)
    xq = kernel_ops.quantize_activations(x)
    out = torch.full((m, n + 5), 7.0)
    kernel_ops.matmul_into(out, 2, xq, k, torch.from_numpy(raw), kind)
    want = x @ reference(kind, raw, k).T
    torch.testing.assert_close(out[:, 2 : 2 + n], want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    assert torch.all(out[:, :2] == 7.0) and torch.all(out[:, 2 + n :] == 7.0)  # other columns untouched


def test_activation_quantization_error_is_small(kernel_ops):
    """Off the grid, the product stays within int8 activation rounding of the float one."""
    kind, k = 14, 1024  # Q6_K
    raw = random_blocks(kind, 64, k)
    x = torch.randn(2, k)
    out = torch.empty(2, 64)
    kernel_ops.matmul_into(out, 0, kernel_ops.quantize_activations(x), k, torch.from_numpy(raw), kind)
    want = x @ reference(kind, raw, k).T
    assert ((out - want).norm() / want.norm()).item() < 0.02


@pytest.mark.skipif(not native.cpu_has_avx512_vnni(), reason="no AVX-512 VNNI on this CPU")
def test_every_build_this_cpu_runs_compiles():
    """A compile error in one ISA build must fail here, not skip every test of that build."""
    assert [isa for isa, _ in builds()] == ["avx512vnni", "avx2"]
    assert gguf_panels.available()


def test_unsupported_type_and_wrong_row_size_are_errors():
    with pytest.raises(ValueError, match="IQ2_XXS has no kernel"):
        GGMLTensor(16, torch.zeros(4, 66, dtype=torch.uint8), 256)
    with pytest.raises(ValueError, match="do not hold"):
        GGMLTensor(8, torch.zeros(4, 30, dtype=torch.uint8), 32)


needs_panels = pytest.mark.skipif(not gguf_panels.available(), reason="no GGUF panel kernels built here")


@needs_panels
@pytest.mark.parametrize(
    "kind", sorted(gguf_panels.LAYOUTS), ids=[KERNEL_TYPES[t][0] for t in sorted(gguf_panels.LAYOUTS)]
)
@pytest.mark.parametrize("m", [1, 5])
def test_panels_hold_the_same_values_and_products(kind, m):
    k, n = 768, 48
    raw = random_blocks(kind, n, k, seed=m)
    ref = reference(kind, raw, k)
    panels = gguf_panels.to_panels(GGMLTensor(kind, torch.from_numpy(raw), k))
    index = torch.tensor([0, 17, 47, 16, 3])
    assert torch.equal(panels.rows(index), ref[index])
    x = grid_activations(m, k)
    out = torch.zeros(m, n + 16)
    panels.matmul_into(out, 16, ggml.ops().quantize_activations(x))
    want = x @ ref.T
    torch.testing.assert_close(out[:, 16:], want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    bytes_per_32 = {6: 22, 7: 24, 12: 19, 13: 23, 14: 26.5, 39: 17}[kind]  # the file: 22, 24, 18, 22, 26.25, 17
    assert panels.nbytes == bytes_per_32 * n * k // 32


@needs_panels
@pytest.mark.parametrize(
    "kind", sorted(gguf_panels.LAYOUTS), ids=[KERNEL_TYPES[t][0] for t in sorted(gguf_panels.LAYOUTS)]
)
def test_the_cpp_relay_writes_the_numpy_relays_bits(kind):
    """Loads re-lay in C++; builds without the kernels in numpy. 272 rows: numpy's two chunks."""
    k, n = 512, 272
    raw = random_blocks(kind, n, k, seed=7)
    t = GGMLTensor(kind, torch.from_numpy(raw), k)
    cpp, numpy_relay = gguf_panels.to_panels(t), gguf_panels.to_panels(t, in_cpp=False)
    assert len(cpp.tensors()) == len(numpy_relay.tensors())
    for a, b in zip(cpp.tensors(), numpy_relay.tensors()):
        assert a.dtype == b.dtype and torch.equal(a, b)
    index = torch.arange(0, n, 13)
    assert torch.equal(numpy_relay.rows(index), reference(kind, raw, k)[index])
    wide = torch.from_numpy(np.concatenate([raw, raw[:, :7]], axis=1))  # rows a strided view of wider ones
    strided = gguf_panels.to_panels(GGMLTensor(kind, wide[:, : raw.shape[1]], k))
    assert all(torch.equal(a, b) for a, b in zip(strided.tensors(), cpp.tensors()))


@pytest.mark.parametrize(
    "kind", sorted(gguf_blocks.EXACT_FORMATS), ids=[KERNEL_TYPES[t][0] for t in sorted(gguf_blocks.EXACT_FORMATS)]
)
def test_exact_conversions_keep_every_value(kind):
    k = 256
    raw = random_blocks(kind, 16, k)
    q = gguf_blocks.to_quantized(GGMLTensor(kind, torch.from_numpy(raw), k))
    assert (q.bits, q.group_size) == (gguf_blocks.EXACT_FORMATS[kind].bits, 32)
    assert torch.equal(q.dequantize(), reference(kind, raw, k))


@needs_panels
@pytest.mark.parametrize("kind", [6, 12, 14, 39], ids=["Q5_0", "Q4_K", "Q6_K", "MXFP4"])
def test_one_call_linear_is_the_same_bits_as_its_steps(kind):
    """panel_linear (quantize, product, bias, silu * up in one call) against the ops one by one."""
    from tokenloom.layers import fused

    assert fused.build()
    k, n, m = 512, 64, 3
    panels = gguf_panels.to_panels(GGMLTensor(kind, torch.from_numpy(random_blocks(kind, n, k)), k))
    x, bias = torch.randn(m, k), torch.randn(n)
    steps = torch.empty(m, n)
    panels.matmul_into(steps, 0, ggml.ops().quantize_activations(x))
    steps += bias
    assert torch.equal(panels.linear(x, bias), steps)
    assert torch.equal(panels.linear(x, bias, silu_mul=True), fused.silu_mul(steps))


@pytest.mark.parametrize("kinds", [(6, 6, 8), (8, 8, 8), (12, 12)], ids=["Q5_0+Q5_0+Q8_0", "Q8_0x3", "Q4_Kx2"])
def test_fused_layer_joins_touching_shards_of_one_type_without_changing_outputs(kinds):
    """A qkv/gate_up layer loads shard by shard; touching shards of one type become one kernel
    call, and each output column is what the shard alone gives."""
    from tokenloom.quant.gguf.modules import GGMLLinear

    k, rows = 256, 32
    raws = [random_blocks(kind, rows, k, seed=i) for i, kind in enumerate(kinds)]
    layer = GGMLLinear(k, rows * len(kinds), bias=False)
    for i in reversed(range(len(kinds))):  # out of order, as a file may hold them
        layer.load_weight(GGMLTensor(kinds[i], torch.from_numpy(raws[i]), k), slice(i * rows, (i + 1) * rows))
    x = torch.randn(2, k)
    y = layer(x)
    for i, kind in enumerate(kinds):
        alone = GGMLLinear(k, rows, bias=False)
        alone.load_weight(GGMLTensor(kind, torch.from_numpy(raws[i]), k))
        assert torch.equal(y[:, i * rows : (i + 1) * rows], alone(x))
    if ggml.ops() is not None and gguf_panels.available():
        runs = 1 + sum(a != b for a, b in itertools.pairwise(kinds))
        assert len(layer.segments) == runs


@needs_panels
@pytest.mark.parametrize(
    "kind", sorted(gguf_panels.LAYOUTS), ids=[KERNEL_TYPES[t][0] for t in sorted(gguf_panels.LAYOUTS)]
)
def test_panel_product_of_a_row_does_not_depend_on_the_batch(kind):
    """Rows go 8 (AVX2) or 4 at a time, then 4, then the rest, through a different loop than a lone
    row (decode): same bits. 15 rows take every pass: 8 + 4 + 3 (AVX2), 4 + 4 + 4 + 3."""
    k, n, m = 512, 32, 15
    panels = gguf_panels.to_panels(GGMLTensor(kind, torch.from_numpy(random_blocks(kind, n, k)), k))
    x = torch.randn(m, k)
    batch = panels.linear(x, None)
    for i in range(m):
        assert torch.equal(batch[i : i + 1], panels.linear(x[i : i + 1], None)), f"row {i}"


@pytest.mark.skipif(not native.cpu_has_avx512_vnni(), reason="no AVX-512 VNNI on this CPU: one build only")
@pytest.mark.parametrize(
    "kind", [*sorted(gguf_panels.LAYOUTS), 8, 3], ids=[KERNEL_TYPES[t][0] for t in [*sorted(gguf_panels.LAYOUTS), 8, 3]]
)
def test_the_avx2_panel_kernels_give_the_vnni_builds_bits(kind):
    """The AVX2 build runs each panel as two halves of 8 rows with maddubs + madd where the VNNI
    build runs dpbusd: the same exact int32 dot products and the same float operations per output,
    so the same bits, for a lone row (decode) and a batch (GGUF panels; Q8_0 and Q4_1 as int8 and
    int4 panels)."""
    from tokenloom.quant.int8 import kernels, panels

    k, n = 512, 48
    raw = GGMLTensor(kind, torch.from_numpy(random_blocks(kind, n, k)), k)
    outs = {}
    for isa, library in (("avx512vnni", "vnni"), ("avx2", "")):
        if kind in gguf_panels.LAYOUTS:
            assert native.load(ggml._SOURCE, "GGUF block kernels", isa)
            ops = getattr(torch.ops, "tokenloom_ggml" + ("_" + library if library else ""))
            p = gguf_panels.to_panels(raw)
            run = lambda x: ops.panel_linear(x, p.kind, p.lo, p.hi, p.scale, p.offset, p.dsup, p.msup, None, False)  # noqa: B023, E731
        else:
            assert native.load(kernels._SOURCE, "int8/int4 CPU kernels", isa)
            ops = getattr(torch.ops, "tokenloom_quant" + ("_" + library if library else ""))
            q = panels.to_panels(gguf_blocks.to_quantized(raw))
            if q.bits == 8:
                run = lambda x: ops.panel_linear_int8(x, q.data, q.scales, 32, None, False)  # noqa: B023, E731
            else:
                run = lambda x: ops.panel_linear_int4(x, q.data, q.scales, q.offsets, 32, None, False)  # noqa: B023, E731
        x = torch.randn(13, k, generator=torch.Generator().manual_seed(kind)) * 3  # 8 + 4 + 1 rows (AVX2)
        outs[isa] = (run(x[:1].contiguous()), run(x))
    assert torch.equal(outs["avx2"][0], outs["avx512vnni"][0]) and torch.equal(outs["avx2"][1], outs["avx512vnni"][1])


@pytest.mark.skipif(not ggml_panels_available(), reason="no int8/int4 panel kernels built here")
@pytest.mark.parametrize("kind", [8, 2, 3], ids=["Q8_0", "Q4_0", "Q4_1"])
@pytest.mark.parametrize(
    "how",
    ["whole, C++ relay", "whole, chunks in torch", "three parts, C++ relay", "three parts, one with a -128 code"],
)
def test_gguf_blocks_load_straight_into_panels_as_the_two_steps_would(kind, how, monkeypatch):
    """QuantizedLinear takes GGUF tensors of its exact format straight into the panel layout,
    whole (a head) or in parts (a fused qkv): the same buffers as loading the row layout and
    re-laying it (use_panels). A part that the panels cannot hold (a Q8_0 code of -128) sends
    the whole weight to the row layout, the parts already in panels included."""
    from tokenloom.quant.int8 import modules, panels

    monkeypatch.setattr(panels, "_CHUNK_ROWS", 32)  # 80 rows: chunks of 32, 32, 16
    if how == "whole, chunks in torch":
        monkeypatch.setattr(modules, "relay_into_panels", lambda *args: False)
    n, k = 80, 256
    raw = random_blocks(kind, n, k)
    if "-128" in how:
        if kind != 8:
            pytest.skip("only Q8_0 has codes the panels cannot hold")
        raw[40, 2] = 0x80  # row 40 (the second part), the first code of its first block
    blocks = GGMLTensor(kind, torch.from_numpy(raw), k)
    fmt = gguf_blocks.EXACT_FORMATS[kind]
    direct, two_steps = (modules.QuantizedLinear(k, n, False, fmt) for _ in range(2))
    parts = [slice(0, n)] if how.startswith("whole") else [slice(0, 32), slice(32, 48), slice(48, 80)]
    for rows in parts:
        direct.load_weight(blocks.rows(rows), rows=rows)
        two_steps.load_weight(gguf_blocks.to_quantized(blocks.rows(rows)), rows=rows)
    assert direct.panel_layout == ("-128" not in how) and not two_steps.panel_layout
    assert two_steps.use_panels() == direct.use_panels() == ("-128" not in how)
    for name in ("qweight", "scales", "offsets"):
        a, b = getattr(direct, name), getattr(two_steps, name)
        assert (a is None and b is None) or (a.shape == b.shape and torch.equal(a, b)), name
    assert torch.equal(direct.weight_q.dequantize(), reference(kind, raw, k))


_DECODE_PRODUCTS = """
import sys, torch
from tokenloom.quant.gguf import blocks as gguf_blocks, panels as gguf_panels
from tokenloom.quant.int8 import kernels, panels
from tokenloom.quant.gguf.tensor import GGMLTensor
from tests.quant.test_gguf_kernels import random_blocks
k, n = 512, 112                             # 7 panels: an odd number per thread either way
x = torch.randn(1, k, generator=torch.Generator().manual_seed(0))
out = {}
for kind in sorted(gguf_panels.LAYOUTS):
    out[kind] = gguf_panels.to_panels(GGMLTensor(kind, torch.from_numpy(random_blocks(kind, n, k)), k)).linear(x, None)
x3 = torch.randn(3, k, generator=torch.Generator().manual_seed(1))
for kind in (8, 3):                         # Q8_0 -> int8 panels, Q4_1 -> int4 panels: one row and three
    q = panels.to_panels(gguf_blocks.to_quantized(GGMLTensor(kind, torch.from_numpy(random_blocks(kind, n, k)), k)))
    out[kind] = kernels.bind(q, None, panel_layout=True)(x)
    out[-kind] = kernels.bind(q, None, panel_layout=True)(x3)
torch.save(out, sys.argv[1])
"""


@needs_panels
@pytest.mark.skipif(not ggml_panels_available(), reason="no int8/int4 panel kernels built here")
def test_decode_gives_the_same_bits_whichever_way_it_walks_the_panels(tmp_path):
    """A lone activation row walks each thread's panels as two halves side by side (AMD) or two
    neighbours at a time with software prefetch (elsewhere): int8, int4 and every GGUF panel type
    give the same bits both ways; int8/int4 batched calls (three rows: key -kind) walk the same way."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    results = []
    for walk in ("split", "adjacent"):
        path = tmp_path / f"{walk}.pt"
        env = {**os.environ, "TOKENLOOM_DECODE_WALK": walk, "PYTHONPATH": str(root)}
        subprocess.run([sys.executable, "-c", _DECODE_PRODUCTS, str(path)], env=env, check=True, cwd=root)
        results.append(torch.load(path))
    assert sorted(results[0]) == sorted([*gguf_panels.LAYOUTS, 3, 8, -3, -8])
    for kind, y in results[0].items():
        assert y.shape == (1 if kind > 0 else 3, 112) and torch.isfinite(y).all()
        assert torch.equal(y, results[1][kind]), KERNEL_TYPES[abs(kind)][0]


@needs_panels
@pytest.mark.parametrize("kinds", [(12, 12), (14, 6), (39, 13)], ids=["Q4_K", "Q6_K+Q5_0", "MXFP4+Q5_K"])
def test_a_tokens_experts_in_one_kernel_are_the_bits_of_their_own_calls(kinds):
    """A decoding token's chosen experts (gate_up and down GGUF panels) run in two passes over all
    their panels (moe_token): each expert's output, and the weighted sum in the order given, are
    those of the per-expert calls and in-place adds the MoE block otherwise makes."""
    from tokenloom.layers.mlp import GatedMLP
    from tokenloom.quant.gguf.modules import GGMLLinear, moe_token

    hidden, inter = 256, 256  # K-quant rows hold 256 values
    experts = []
    for e in range(3):
        mlp = GatedMLP(hidden, inter, False, "silu")
        mlp.gate_up_proj, mlp.down_proj = GGMLLinear(hidden, 2 * inter, False), GGMLLinear(inter, hidden, False)
        up = random_blocks(kinds[0], 2 * inter, hidden, seed=e)
        down = random_blocks(kinds[1], hidden, inter, seed=10 + e)
        mlp.gate_up_proj.load_weight(GGMLTensor(kinds[0], torch.from_numpy(up), hidden))
        mlp.down_proj.load_weight(GGMLTensor(kinds[1], torch.from_numpy(down), inter))
        experts.append(mlp)
    x, weights = torch.randn(1, hidden), [0.5, 0.25, 0.125]
    want = experts[0].forward(x).mul_(weights[0])
    for mlp, w in zip(experts[1:], weights[1:]):
        want.add_(mlp.forward(x), alpha=w)
    fields = [(m.gate_up_proj.panel_fields()[1], m.down_proj.panel_fields()[1]) for m in experts]
    assert torch.equal(moe_token(x, kinds, fields, weights), want)
