"""GroupedLinear (DeepSeek's per-head k_b and v_b): each group's map applied to its own input, from
float weights and from GGUF blocks kept as int8 codes; the decode kernel and the batched matmul of
longer steps give what the dequantized weights give, and a GGUF model keeps its blocks so."""

from __future__ import annotations

import gguf
import pytest
import torch

from tokenloom.layers.grouped import KERNEL_ROWS, GroupedLinear, kernel_built
from tokenloom.quant.gguf.tensor import GGMLTensor

G, N, K = 4, 48, 64


def blocks(w: torch.Tensor, kind: str) -> GGMLTensor:
    t = gguf.GGMLQuantizationType[kind]
    raw = gguf.quants.quantize(w.numpy(), t)
    return GGMLTensor(t.value, torch.from_numpy(raw.reshape(w.shape[0], -1)), w.shape[1], None)


def per_group(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The reference: out[t, g] = w[g] @ x[t, g], one group at a time. x (T, G, K), w (G, N, K)."""
    return torch.stack([x[:, g] @ w[g].T for g in range(w.shape[0])], dim=1)


def test_float_weights_map_each_group_by_its_own_matrix():
    w = torch.randn(G * N, K)
    layer = GroupedLinear(G, K, N)
    layer.load_weight(w)
    x = torch.randn(3, G, K)
    torch.testing.assert_close(layer(x), per_group(x, w.view(G, N, K)))
    assert layer.codes is None


@pytest.mark.skipif(not kernel_built(), reason="the grouped kernel does not build here")
@pytest.mark.parametrize("kind", ["Q8_0", "Q5_0", "Q4_0", "Q4_1"])
@pytest.mark.parametrize("rows", [1, KERNEL_ROWS, 20])  # the kernel's steps, and a batched matmul's
def test_gguf_blocks_stay_codes_and_give_the_dequantized_weights_products(kind, rows):
    t = blocks(torch.randn(G * N, K) * 0.1, kind)
    layer = GroupedLinear(G, K, N)
    layer.load_weight(t)
    assert layer.weight is None and layer.codes.dtype == torch.int8  # no float copy kept
    assert (layer.offsets is not None) == (kind in ("Q4_0", "Q4_1"))
    x = torch.randn(rows, G, K)
    want = per_group(x, t.dequantize().view(G, N, K))
    torch.testing.assert_close(layer(x), want, rtol=1e-5, atol=1e-5)


def test_a_type_without_int8_codes_is_read_as_float():
    t = blocks(torch.randn(G * N, K) * 0.1, "MXFP4")  # e2m1 codes and e8m0 scales: dequantized
    layer = GroupedLinear(G, K, N)
    layer.load_weight(t)
    assert layer.codes is None
    torch.testing.assert_close(layer.weight, t.dequantize())


def test_a_tensor_of_the_wrong_shape_is_refused_naming_both():
    with pytest.raises(ValueError, match=r"has shape \(8, 64\), expected \(192, 64\)"):
        GroupedLinear(G, K, N).load_weight(torch.zeros(8, 64))


@pytest.mark.skipif(not kernel_built(), reason="the grouped kernel does not build here")
def test_a_quantized_deepseek_gguf_keeps_k_b_and_v_b_as_codes(tiny_model_dir, tmp_path):
    from tests.helpers.gguf_writer import write_gguf
    from tokenloom import LLM

    path = write_gguf(tiny_model_dir("deepseek_v2"), tmp_path / "q8.gguf", quantize="Q8_0")
    kept = LLM(str(path), kv_cache_memory=16 << 20)
    attn = kept.engine.core.runner.model.model.layers[1].self_attn
    assert attn.k_b.codes is not None and attn.v_b.codes is not None
    read_as_float = LLM(str(path), kv_cache_memory=16 << 20, dtype="float32")
    float_attn = read_as_float.engine.core.runner.model.model.layers[1].self_attn
    assert float_attn.k_b.codes is None
    for kept_map, float_map in ((attn.k_b, float_attn.k_b), (attn.v_b, float_attn.v_b)):
        assert torch.equal(kept_map.dequantized(), float_map.dequantized())  # the file's values, unchanged
