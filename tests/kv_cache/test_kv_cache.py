"""The KV cache tensors: block copies (copy-on-write) move every byte of a block, scales included."""

from __future__ import annotations

import pytest
import torch

from tokenloom.kv_cache.paged import PagedKVCache
from tokenloom.kv_cache.quantized import QUANTIZED_CACHES
from tokenloom.models.config import ModelConfig


def small_config(head_dim: int = 8) -> ModelConfig:
    return ModelConfig(
        architecture="LlamaForCausalLM",
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_layers=2,
        num_heads=2,
        num_kv_heads=1,
        head_dim=head_dim,
        max_model_len=64,
    )


@pytest.mark.parametrize("kv_cache_dtype,head_dim", [("auto", 8), ("int8", 8), ("int4", 32)])
def test_copy_blocks_copies_whole_blocks_in_every_layer(kv_cache_dtype, head_dim):
    kv = PagedKVCache(
        small_config(head_dim),
        num_blocks=6,
        block_size=4,
        dtype=torch.float32,
        device="cpu",
        kv_cache_dtype=kv_cache_dtype,
    )
    gen = torch.Generator().manual_seed(0)
    for cache in kv.keys + kv.values:  # fill blocks 0..5 with noise
        x = torch.randn(24, 1, head_dim, generator=gen)
        if isinstance(cache, QUANTIZED_CACHES):
            cache.store(torch.arange(24), x)
        else:
            cache.view(-1, 1, head_dim)[:24] = x
    before = [cache[torch.arange(7)].clone() for cache in kv.keys + kv.values]  # (7, 4, 1, 8) dequantized
    kv.copy_blocks([(1, 4), (2, 5)])
    for cache, old in zip(kv.keys + kv.values, before):
        now = cache[torch.arange(7)]
        assert torch.equal(now[4], old[1]) and torch.equal(now[5], old[2])
        assert torch.equal(now[:4], old[:4]) and torch.equal(now[6], old[6])  # nothing else moved
        assert not torch.equal(old[4], old[1])
