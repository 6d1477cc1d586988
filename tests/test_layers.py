"""CPU layout swaps must compute the same function as nn.Linear."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tokenloom.models.layers import DualLayoutLinear, onednn_linear


@pytest.mark.parametrize("rows", [1, 2, 3, 8, 64])
@pytest.mark.parametrize("bias", [False, True])
def test_dual_layout_linear_matches_linear(rows, bias):
    torch.manual_seed(0)
    ref = nn.Linear(48, 96, bias=bias)
    x = torch.randn(rows, 48)
    torch.testing.assert_close(DualLayoutLinear(ref)(x), ref(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 8, 64])
def test_onednn_linear_matches_linear(rows):
    torch.manual_seed(0)
    ref = nn.Linear(48, 200, bias=False)
    x = torch.randn(rows, 48)
    with torch.inference_mode():
        torch.testing.assert_close(onednn_linear(ref)(x), ref(x), rtol=1e-5, atol=1e-5)


def test_swapped_modules_keep_parameters_loadable(tiny_model_dir):
    from tokenloom.loader import load_model
    loaded = load_model(tiny_model_dir("llama_gqa"))
    layer = loaded.model.model.layers[0]
    assert isinstance(layer.mlp.gate_up_proj, DualLayoutLinear)
    assert isinstance(layer.self_attn.qkv_proj, DualLayoutLinear)
    assert isinstance(layer.mlp.down_proj, nn.Linear)   # narrow output: F.linear measured faster
