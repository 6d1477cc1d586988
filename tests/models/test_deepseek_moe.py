"""DeepSeek's mixture (models/moe.py route) against transformers' own modules on the same
random weights: V3's sigmoid scores with a correction bias for the choice, groups ranked by their
two best, renormalized and scaled weights and an ungated shared expert; V2's softmax scores with
groups ranked by their best. Many tokens (the grouped path) and one (the decode path)."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tokenloom.models.config import ModelConfig, MoeConfig
from tokenloom.models.moe import SparseMoeBlock

HIDDEN, INTER, EXPERTS = 32, 16, 8


def ours(moe: MoeConfig) -> SparseMoeBlock:
    cfg = ModelConfig("MixtralForCausalLM", 64, HIDDEN, 1, 4, 4, 8, 64, 128, moe=moe)
    return SparseMoeBlock(cfg).eval()


def copy_weights(block: SparseMoeBlock, hf) -> None:
    with torch.no_grad():
        block.gate.weight.copy_(hf.gate.weight)
        if block.gate.e_score_correction_bias is not None:
            block.gate.e_score_correction_bias.copy_(hf.gate.e_score_correction_bias)
        for e, expert in enumerate(block.experts):
            expert.gate_up_proj.weight.copy_(hf.experts.gate_up_proj[e])  # gate rows, then up rows
            expert.down_proj.weight.copy_(hf.experts.down_proj[e])
        s = hf.shared_experts
        block.shared_expert.gate_up_proj.weight.copy_(torch.cat([s.gate_proj.weight, s.up_proj.weight]))
        block.shared_expert.down_proj.weight.copy_(s.down_proj.weight)


def hf_moe(version: str):
    common = dict(
        hidden_size=HIDDEN, moe_intermediate_size=INTER, n_routed_experts=EXPERTS, num_experts_per_tok=3,
        n_shared_experts=2, n_group=4, topk_group=2, routed_scaling_factor=2.5,
    )  # fmt: skip
    torch.manual_seed(0)
    if version == "v3":
        module = transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3MoE(
            transformers.DeepseekV3Config(**common, norm_topk_prob=True)
        )
    else:
        module = transformers.models.deepseek_v2.modeling_deepseek_v2.DeepseekV2Moe(
            transformers.DeepseekV2Config(**common, topk_method="group_limited_greedy")
        )
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0.0, 0.3)
        if version == "v3":  # a bias large enough to change choices
            module.gate.e_score_correction_bias.normal_(0.0, 0.5)
    return module.eval()


@pytest.mark.parametrize("version", ["v3", "v2"])
@pytest.mark.parametrize("tokens", [9, 1])
def test_the_mixture_matches_transformers(version, tokens):
    hf = hf_moe(version)
    v3 = version == "v3"
    moe = MoeConfig(
        EXPERTS,
        3,
        INTER,
        (0,),
        normalize_top_k=v3,
        shared_intermediate_size=2 * INTER,
        scoring="sigmoid" if v3 else "softmax",
        groups=4,
        topk_groups=2,
        routed_scaling=2.5,
        correction_bias=v3,
        shared_gated=False,
    )
    block = ours(moe)
    copy_weights(block, hf)
    x = torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(tokens))
    with torch.no_grad():
        torch.testing.assert_close(block(x), hf(x[None])[0], rtol=1e-5, atol=1e-5)
        if v3 and tokens > 1:  # the bias changes which experts run: without it the output differs
            block.gate.e_score_correction_bias.zero_()
            assert (block(x) - hf(x[None])[0]).abs().max() > 1e-3
