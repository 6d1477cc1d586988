"""The mixture-of-experts block on its own: grouped execution, the one-token decode path."""

from __future__ import annotations

import torch

from tokenloom.models.config import ModelConfig, MoeConfig
from tokenloom.models.moe import SparseMoeBlock, route


def _block(experts: int = 8, top_k: int = 2, shared: int = 0) -> SparseMoeBlock:
    cfg = ModelConfig(
        "MixtralForCausalLM",
        64,
        32,
        1,
        4,
        2,
        8,
        16,
        128,
        moe=MoeConfig(experts, top_k, 16, (0,), shared_intermediate_size=shared),
    )
    torch.manual_seed(0)
    block = SparseMoeBlock(cfg)
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.5)
    return block


def test_each_chosen_expert_runs_once_over_all_its_tokens():
    block = _block()
    calls = []
    for i, expert in enumerate(block.experts):
        run = expert.forward
        expert.forward = lambda rows, i=i, run=run: (calls.append((i, rows.shape[0])), run(rows))[1]
    x = torch.randn(13, 32)
    _, chosen = route(block.gate(x), block.moe)
    block.forward(x)
    expected = {e: int((chosen == e).sum()) for e in chosen.unique().tolist()}
    assert dict(calls) == expected and len(calls) == len(expected)


def test_one_token_path_matches_the_grouped_path():
    """Decode's single token skips the grouping ops; the sum is the same (matmuls over other
    row counts may round differently in the last bit)."""
    block = _block(shared=24)
    x = torch.randn(6, 32)
    together = block.forward(x)
    for t in range(6):
        torch.testing.assert_close(block.forward(x[t : t + 1]), together[t : t + 1], rtol=1e-5, atol=1e-5)


def test_routing_weights_are_the_top_k_softmax_probabilities():
    logits = torch.tensor([[0.0, 2.0, 1.0, -1.0]])
    probs = torch.softmax(logits, -1)[0]
    weights, experts = route(logits, MoeConfig(4, 2, 8, (0,), normalize_top_k=False))
    assert experts.tolist() == [[1, 2]]
    torch.testing.assert_close(weights[0], probs[[1, 2]])
    weights, _ = route(logits, MoeConfig(4, 2, 8, (0,), normalize_top_k=True))
    torch.testing.assert_close(weights[0], probs[[1, 2]] / probs[[1, 2]].sum())
