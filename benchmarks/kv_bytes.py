#!/usr/bin/env python
"""KV-cache bytes per token of DeepSeek's latent attention beside full attention of the same width.

Each model's ModelConfig comes from its HF config (as the engine reads it) and its bytes from
``kv_bytes_per_token``, the function that sizes the engine's cache. Beside each DeepSeek model: the
same layers with multi-head attention over its hidden size (heads x hidden / heads keys and values,
as a Llama of that width caches them), and MLA's own heads expanded (keys of nope + rope, values of
v_head_dim per head: what a cache of decompressed keys and values would hold).

    python benchmarks/kv_bytes.py
"""

from __future__ import annotations

import torch

from tokenloom.kv_cache.paged import kv_bytes_per_token
from tokenloom.models.config import ModelConfig

# the released models' config.json fields that size their caches
MODELS = {
    "DeepSeek-V2-Lite": dict(
        architectures=["DeepseekV2ForCausalLM"], vocab_size=102400, hidden_size=2048, intermediate_size=10944,
        num_hidden_layers=27, num_attention_heads=16, num_key_value_heads=16, kv_lora_rank=512, q_lora_rank=None,
        qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, moe_intermediate_size=1408, n_routed_experts=64,
        num_experts_per_tok=6, n_shared_experts=2, first_k_dense_replace=1, max_position_embeddings=163840,
    ),
    "DeepSeek-V3": dict(
        architectures=["DeepseekV3ForCausalLM"], vocab_size=129280, hidden_size=7168, intermediate_size=18432,
        num_hidden_layers=61, num_attention_heads=128, num_key_value_heads=128, kv_lora_rank=512, q_lora_rank=1536,
        qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, moe_intermediate_size=2048, n_routed_experts=256,
        num_experts_per_tok=8, n_shared_experts=1, first_k_dense_replace=3, n_group=8, topk_group=4,
        max_position_embeddings=163840,
    ),
}  # fmt: skip


def full_attention(hf: dict) -> ModelConfig:
    """A Llama of the model's width and depth: multi-head attention over hidden / heads dims."""
    return ModelConfig(
        "LlamaForCausalLM",
        hf["vocab_size"],
        hf["hidden_size"],
        hf["num_hidden_layers"],
        hf["num_attention_heads"],
        hf["num_attention_heads"],
        hf["hidden_size"] // hf["num_attention_heads"],
        hf["intermediate_size"],
        hf["max_position_embeddings"],
    )


def expanded_mla_bytes(hf: dict, element: int) -> int:
    """Keys (nope + rope) and values (v_head_dim) of every head, every layer."""
    per_head = hf["qk_nope_head_dim"] + hf["qk_rope_head_dim"] + hf["v_head_dim"]
    return hf["num_hidden_layers"] * hf["num_attention_heads"] * per_head * element


def main() -> None:
    print("| model | cache dtype | MLA latent B/token | MLA heads expanded | full attention, same width | ratio |")
    print("|---|---|---:|---:|---:|---:|")
    for name, hf in MODELS.items():
        mla = ModelConfig.from_hf(hf)
        for dtype in (torch.bfloat16, torch.float32):
            latent = kv_bytes_per_token(mla, dtype)
            full = kv_bytes_per_token(full_attention(hf), dtype)
            expanded = expanded_mla_bytes(hf, torch.empty((), dtype=dtype).element_size())
            print(
                f"| {name} | {str(dtype).removeprefix('torch.')} | {latent:,} | {expanded:,} | {full:,} "
                f"| {full / latent:.1f}x less |"
            )


if __name__ == "__main__":
    main()
