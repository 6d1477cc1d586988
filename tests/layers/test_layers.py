"""CPU layout swaps and fused glue must compute the same function as the torch ops they replace."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tokenloom.kernels import native
from tokenloom.layers.prepacked import PackedLinear, PanelLinear

needs_panel_kernel = pytest.mark.skipif(
    not PanelLinear.supports(nn.Linear(16, 16)), reason="no AVX2 CPU or the kernel could not be built"
)


@pytest.mark.parametrize("rows", [1, 2, 3, 8, 64, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_linear(rows, bias):
    torch.manual_seed(0)
    ref = nn.Linear(48, 200, bias=bias)
    x = torch.randn(rows, 48)
    with torch.inference_mode():
        torch.testing.assert_close(PackedLinear(ref)(x), ref(x), rtol=1e-5, atol=1e-5)


@needs_panel_kernel
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 14, 15, 16, 23, 64, 300])
@pytest.mark.parametrize("in_features,out_features,bias", [(48, 200, False), (37, 16, True), (576, 1000, True)])
def test_panel_linear_matches_linear(rows, in_features, out_features, bias):
    """Each blocking (AVX-512: one block up to 14 rows, 8-row blocks and remainders beyond;
    AVX2: up to 6 rows, 6-row blocks beyond), with and without the next panels fetched ahead,
    widths that are not whole panels, bias."""
    torch.manual_seed(rows)
    ref = nn.Linear(in_features, out_features, bias=bias)
    x = torch.randn(rows, in_features)
    with torch.inference_mode():
        torch.testing.assert_close(PanelLinear(ref)(x), ref(x), rtol=1e-5, atol=1e-5)


@needs_panel_kernel
def test_panel_linear_keeps_leading_dims_and_is_batch_invariant_bit_for_bit():
    torch.manual_seed(0)
    layer = PanelLinear(nn.Linear(96, 130))
    x = torch.randn(2, 17, 96)
    with torch.inference_mode():
        batched = layer(x)
        assert batched.shape == (2, 17, 130)
        for b, t in [(0, 0), (0, 8), (1, 16), (1, 3)]:
            assert torch.equal(layer(x[b, t : t + 1]), batched[b, t : t + 1])  # alone == among 33 others


@needs_panel_kernel
def test_panel_linear_rows_are_the_same_bits_under_every_blocking():
    """Calls of 1-40 rows use every block height and prefetch choice; row i never changes."""
    torch.manual_seed(1)
    layer = PanelLinear(nn.Linear(576, 1000, bias=True))
    x = torch.randn(40, 576)
    with torch.inference_mode():
        alone = torch.cat([layer(x[i : i + 1]) for i in range(40)])
        for rows in range(2, 41):
            assert torch.equal(layer(x[:rows]), alone[:rows]), f"{rows} rows"


def test_every_float32_projection_is_packed_and_tied_embedding_survives(tiny_model_dir):
    from tokenloom.loader import load_model

    loaded = load_model(tiny_model_dir("llama_gqa"))
    model = loaded.model
    assert not [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    layer = model.model.layers[0]
    kind = PanelLinear if PanelLinear.supports(nn.Linear(16, 16)) else PackedLinear
    assert isinstance(layer.mlp.down_proj, kind) and isinstance(model.lm_head, kind)
    assert model.model.embed_tokens.weight.layout == torch.strided  # the embedding stays dense


def test_other_dtypes_keep_plain_linear(tiny_model_dir):
    from tokenloom.loader import load_model

    loaded = load_model(tiny_model_dir("llama_gqa"), dtype="bfloat16")
    assert isinstance(loaded.model.lm_head, nn.Linear)


def test_fused_glue_equals_the_torch_ops_it_replaces():
    from tokenloom.kernels import native
    from tokenloom.layers import fused
    from tokenloom.layers.mlp import GatedMLP
    from tokenloom.layers.norms import RMSNorm
    from tokenloom.layers.rope import _rotate_half, apply_rope, rope_cos_sin, rope_inv_freq
    from tokenloom.models.config import RopeConfig

    if not native.cpu_has_avx2():
        pytest.skip("the fused ops need AVX2 + FMA")
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(9, 96, generator=gen)
    assert fused.enabled(x)
    norm = RMSNorm(96, 1e-5)
    norm.weight.data = torch.randn(96, generator=gen)
    want = norm.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5))
    torch.testing.assert_close(norm(x), want, atol=2e-6, rtol=2e-6)
    assert torch.equal(norm(x[3:4]), norm(x)[3:4])  # a row alone: the same bits
    residual = torch.randn(9, 96, generator=gen)
    normed, total = norm.add_forward(x, residual)  # fused residual add + norm
    assert torch.equal(total, residual + x) and torch.equal(normed, norm(residual + x))
    qkv = torch.randn(9, 5 * 16, generator=gen)
    qk = qkv[:, : 4 * 16].view(9, 4, 16)  # a strided view, as in attention
    cos, sin = rope_cos_sin(rope_inv_freq(RopeConfig(), 16), torch.arange(9), torch.float32)
    torch.testing.assert_close(apply_rope(qk, cos, sin), qk * cos + _rotate_half(qk) * sin, atol=1e-6, rtol=1e-6)
    mlp = GatedMLP(96, 40, False, "silu")
    gate, up = mlp.gate_up_proj(x).split(40, dim=-1)
    torch.testing.assert_close(mlp(x), mlp.down_proj(torch.nn.functional.silu(gate) * up), atol=1e-5, rtol=1e-5)
    gate_up = torch.randn(5, 2 * 3075, generator=gen) * 6  # vector lanes and a scalar tail
    want = torch.nn.functional.silu(gate_up[:, :3075]) * gate_up[:, 3075:]
    torch.testing.assert_close(fused.silu_mul(gate_up), want, atol=0, rtol=2.4e-7)  # within 2 ulp of torch


def test_loading_builds_the_cpu_kernels_before_the_first_forward(tiny_model_dir, monkeypatch):
    """Their one-time "compiling" messages must come while loading, not inside streamed text."""
    from tokenloom.kernels import native
    from tokenloom.layers import fused
    from tokenloom.loader import load_model

    requested = []
    real_load = native.load
    monkeypatch.setattr(
        native, "load", lambda source, what, isa="avx2": requested.append(source.name) or real_load(source, what, isa)
    )
    monkeypatch.setattr(native, "_fastest", {})  # other tests may already have picked the builds
    monkeypatch.setattr(fused, "_built", None)
    load_model(tiny_model_dir("llama_gqa"))
    assert {"fused_cpu.cpp", "paged_decode_cpu.cpp"} <= set(requested)
    requested.clear()
    load_model(tiny_model_dir("llama_gqa"), quantization="int8")
    assert "quant_cpu.cpp" in requested


def test_a_kernel_already_built_is_not_announced_as_compiling(caplog):
    """The "compiling ... (once, ~15 s)" line comes only when a build will run: it looked for the
    .so outside torch's py311_cpu/ folder and printed on every start."""
    import logging

    from tokenloom.kernels import native
    from tokenloom.layers import fused

    assert fused.build()  # built (or loaded from the cache) once here
    with caplog.at_level(logging.INFO, logger="tokenloom.kernels.native"):
        assert native._build(fused._SOURCE, "fused decoder ops", "avx2")
    assert not [r for r in caplog.records if "compiling" in r.getMessage()]


def test_a_kernel_is_rebuilt_when_a_header_it_includes_changes(tmp_path):
    """The build cache is named by a hash of the source and its quoted includes."""
    from tokenloom.kernels import native

    (tmp_path / "sub").mkdir()
    source = tmp_path / "sub" / "k.cpp"
    source.write_text('#include <vector>\n#include "../h.h"\nint f() { return g(); }\n')
    (tmp_path / "h.h").write_text("inline int g() { return 1; }\n")
    before = native._text_with_headers(source)
    (tmp_path / "h.h").write_text("inline int g() { return 2; }\n")
    assert native._text_with_headers(source) != before


@needs_panel_kernel
@pytest.mark.parametrize("bias", [False, True])
def test_panel_silu_mul_epilogue_is_the_same_bits_as_linear_then_fused_silu_mul(bias):
    """Every blocking of the gated kernel (AVX-512: 1-14 rows in one block, 12-row blocks
    beyond; AVX2: 1-3 rows, 3-row blocks), pre-activations from -100 to 100 (exp over- and
    underflow), with and without bias."""
    from tokenloom.layers import fused

    if not fused.build():
        pytest.skip("fused ops not built")
    torch.manual_seed(2)
    ref = nn.Linear(64, 2 * 96, bias=bias)
    with torch.no_grad():
        ref.weight.mul_(8.0)
    layer = PanelLinear(ref)
    assert layer.pairs_gate_up
    x = torch.randn(40, 64) * torch.logspace(-3, 1.3, 40)[:, None]  # rows from tiny to huge
    with torch.inference_mode():
        assert layer(x).abs().max() > 100  # exp(-g) over- and underflows
        for rows in (1, 2, 3, 4, 5, 6, 9, 14, 15, 23, 26, 40):
            expected = fused.silu_mul(layer(x[:rows]))
            assert torch.equal(layer.silu_mul(x[:rows]), expected), f"{rows} rows"


@pytest.mark.skipif(not native.cpu_has_avx512(), reason="no AVX-512 on this CPU: one build only")
def test_the_avx2_panel_build_gives_the_avx512_builds_bits():
    """A panel row is one zmm in one build, two ymm in the other, and the register blocks differ;
    each output is the same FMA chain over k in order, so a dense product is the same bits, for
    a lone row (decode) and for every block height of either build."""
    from tokenloom.layers import prepacked

    torch.manual_seed(3)
    weight, bias = torch.randn(200, 576), torch.randn(200)
    x = torch.randn(40, 576)
    outs = {}
    for isa in ("avx512", "avx2"):
        assert native.load(prepacked._PANEL_SOURCE, "float32 linear panel kernel", isa)
        ops = getattr(torch.ops, f"tokenloom_panel_{isa}")
        panels = ops.pack(weight)
        outs[isa] = [ops.linear(x[:rows].contiguous(), panels, 200, bias) for rows in (1, 3, 7, 14, 40)]
    for rows, a, b in zip((1, 3, 7, 14, 40), outs["avx512"], outs["avx2"]):
        assert torch.equal(a, b), f"{rows} rows"


def test_gated_mlp_picks_the_epilogue_only_for_whole_panel_halves():
    kind_ok = PanelLinear.supports(nn.Linear(16, 16))
    if not kind_ok:
        pytest.skip("needs the panel kernel")
    assert PanelLinear(nn.Linear(8, 64)).pairs_gate_up
    assert not PanelLinear(nn.Linear(8, 48)).pairs_gate_up  # halves of 24: not whole panels
