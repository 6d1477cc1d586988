"""The KV cache tensors: block copies (copy-on-write) move every byte of a block, scales included."""

from __future__ import annotations

import pytest
import torch

from tokenloom.kv_cache.paged import Int8Cache, PagedKVCache
from tokenloom.models.config import ModelConfig


def small_config() -> ModelConfig:
    return ModelConfig(
        architecture="LlamaForCausalLM",
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_layers=2,
        num_heads=2,
        num_kv_heads=1,
        head_dim=8,
        max_model_len=64,
    )


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_copy_blocks_copies_whole_blocks_in_every_layer(kv_cache_dtype):
    kv = PagedKVCache(
        small_config(), num_blocks=6, block_size=4, dtype=torch.float32, device="cpu", kv_cache_dtype=kv_cache_dtype
    )
    gen = torch.Generator().manual_seed(0)
    for cache in kv.keys + kv.values:  # fill blocks 0..5 with noise
        x = torch.randn(24, 1, 8, generator=gen)
        if isinstance(cache, Int8Cache):
            cache.store(torch.arange(24), x)
        else:
            cache.view(-1, 1, 8)[:24] = x
    before = [cache[torch.arange(7)].clone() for cache in kv.keys + kv.values]  # (7, 4, 1, 8) dequantized
    kv.copy_blocks([(1, 4), (2, 5)])
    for cache, old in zip(kv.keys + kv.values, before):
        now = cache[torch.arange(7)]
        assert torch.equal(now[4], old[1]) and torch.equal(now[5], old[2])
        assert torch.equal(now[:4], old[:4]) and torch.equal(now[6], old[6])  # nothing else moved
        assert not torch.equal(old[4], old[1])
