"""CPU layout swaps must compute the same function as nn.Linear."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tokenloom.models.layers import PackedLinear


@pytest.mark.parametrize("rows", [1, 2, 3, 8, 64, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_linear(rows, bias):
    torch.manual_seed(0)
    ref = nn.Linear(48, 200, bias=bias)
    x = torch.randn(rows, 48)
    with torch.inference_mode():
        torch.testing.assert_close(PackedLinear(ref)(x), ref(x), rtol=1e-5, atol=1e-5)


def test_every_float32_projection_is_packed_and_tied_embedding_survives(tiny_model_dir):
    from tokenloom.loader import load_model
    loaded = load_model(tiny_model_dir("llama_gqa"))
    model = loaded.model
    assert not [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    layer = model.model.layers[0]
    assert isinstance(layer.mlp.down_proj, PackedLinear) and isinstance(model.lm_head, PackedLinear)
    assert model.model.embed_tokens.weight.layout == torch.strided   # the embedding stays dense


def test_other_dtypes_keep_plain_linear(tiny_model_dir):
    from tokenloom.loader import load_model
    loaded = load_model(tiny_model_dir("llama_gqa"), dtype="bfloat16")
    assert isinstance(loaded.model.lm_head, nn.Linear)
