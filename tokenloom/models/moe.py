"""Mixture-of-experts decoders: Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE.

Attention is Llama's (with Qwen2's q/k/v bias or Qwen3's q/k norm, from ModelConfig flags;
OLMoE's is OLMo 2's, q/k normed over the whole projection); the MLP of each layer in
``MoeConfig.sparse_layers`` is a ``SparseMoeBlock``:

- a router (``gate``, kept float) scores the experts; softmax in float32, top-k,
  renormalized over the chosen k where the family does (Mixtral; Qwen per norm_topk_prob);
- each expert is a gated MLP like the dense one, so every weight format (float panels,
  int8/int4, GGUF blocks) runs experts with the same kernels;
- the routed (token, expert) pairs are sorted by expert and each expert that has tokens
  runs once over all of them (a grouped matmul: no per-token loop), then the weighted
  rows are added back to their tokens in expert order, as transformers adds them;
- Qwen2-MoE adds a shared expert scaled by sigmoid(shared_expert_gate(x)).
"""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from tokenloom.layers.mlp import ClampedSwiGLUMLP, GatedMLP
from tokenloom.models.config import ModelConfig, MoeConfig
from tokenloom.models.llama import LlamaDecoderLayer, LlamaForCausalLM
from tokenloom.models.olmo2 import Olmo2Attention
from tokenloom.quant.gguf.modules import GGMLLinear, moe_token


class Router(nn.Module):
    """A projection (bias-free unless `bias`: gpt-oss) that stays in the model's float dtype (never
    quantized or prepacked: which experts a token picks must not move with the weight format):
    x (T, in) -> (T, out)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, correction: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        # DeepSeek-V3: added to the scores for choosing experts only (route)
        self.e_score_correction_bias = nn.Parameter(torch.empty(out_features)) if correction else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


def _expert(cfg: ModelConfig) -> GatedMLP:
    """One expert: the model's gated MLP, or gpt-oss's clamped SwiGLU with biases."""
    moe = cfg.moe
    assert moe is not None  # a MoE model's config describes its experts
    if moe.swiglu_limit is not None:
        return ClampedSwiGLUMLP(cfg.hidden_size, moe.intermediate_size, moe.swiglu_alpha, moe.swiglu_limit)
    return GatedMLP(cfg.hidden_size, moe.intermediate_size, False, cfg.hidden_act)


def route(
    logits: torch.Tensor, moe: MoeConfig, correction: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits (T, E) -> (weights (T, k) float32, experts (T, k) int64), best first, as
    transformers' routers compute them. Scores are the logits' softmax (sigmoid where `moe.scoring`
    says: DeepSeek-V3); the experts are the top-k by score plus `correction` (V3's bias; None: none),
    among the topk_groups of `moe.groups` groups ranked best where there are groups (a group by its
    best score, DeepSeek-V2; by its two best summed, V3); a chosen expert's weight is its score,
    renormalized over the chosen where normalize_top_k, times routed_scaling. With one group, no
    bias and no scaling: Mixtral's, Qwen's, OLMoE's and gpt-oss's softmax top-k."""
    logits = logits.float()
    scores = torch.sigmoid(logits) if moe.scoring == "sigmoid" else torch.softmax(logits, dim=-1)
    choice = scores if correction is None else scores + correction.float()
    if moe.groups > 1:
        grouped = choice.view(-1, moe.groups, moe.num_experts // moe.groups)  # (T, G, E / G)
        rank = grouped.topk(2, dim=-1).values.sum(-1) if moe.scoring == "sigmoid" else grouped.amax(-1)  # (T, G)
        kept = torch.zeros_like(rank, dtype=torch.bool).scatter_(1, rank.topk(moe.topk_groups, dim=-1).indices, True)
        dropped = ~kept.repeat_interleave(moe.num_experts // moe.groups, dim=1)  # (T, E)
        choice = choice.masked_fill(dropped, float("-inf"))
    if choice is scores:  # no bias, no groups: the top-k's values are the chosen weights
        weights, experts = scores.topk(moe.top_k, dim=-1)
    else:
        experts = choice.topk(moe.top_k, dim=-1).indices
        weights = scores.gather(1, experts)
    if moe.normalize_top_k:  # + 1e-20 (V3's guard) leaves a softmax top-k's sum (>= 1/E) as it is
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return (weights * moe.routed_scaling if moe.routed_scaling != 1.0 else weights), experts


class SparseMoeBlock(nn.Module):
    """x (T, hidden) -> sum over each token's top-k experts of weight * expert(x) [+ shared expert]."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        moe = cfg.moe
        assert moe is not None  # a MoE model's config describes its experts
        self.moe, self.top_k = moe, moe.top_k
        self.gate = Router(cfg.hidden_size, moe.num_experts, moe.router_bias, moe.correction_bias)
        self.experts = nn.ModuleList(_expert(cfg) for _ in range(moe.num_experts))
        self._panels_found = False  # _panel_experts, once loaded
        self._panels: tuple[tuple[int, int], list[tuple[list, list]]] | None = None
        self.shared_expert: GatedMLP | None = None
        self.shared_expert_gate: Router | None = None
        if moe.shared_intermediate_size:
            self.shared_expert = GatedMLP(cfg.hidden_size, moe.shared_intermediate_size, False, cfg.hidden_act)
            if moe.shared_gated:
                self.shared_expert_gate = Router(cfg.hidden_size, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, experts = route(self.gate(x), self.moe, self.gate.e_score_correction_bias)  # each (T, k)
        out = self.mix_experts(x, weights, experts)
        if self.shared_expert is not None:
            shared = self.shared_expert.forward(x)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
            out.add_(shared)  # out: this call's own tensor
        return out

    def mix_experts(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """x (T, H), weights/experts (T, k) -> (T, H): each expert runs once over its tokens."""
        if x.shape[0] == 1:
            return self._mix_one_token(x, weights[0].tolist(), experts[0].tolist())
        flat = experts.flatten()  # (T k,) row t*k + j: token t's j-th expert
        order = torch.argsort(flat, stable=True)  # routed rows grouped by expert
        counts = torch.bincount(flat, minlength=len(self.experts)).tolist()
        token_of = order // self.top_k  # (T k,) the token of each grouped row
        rows = x.index_select(0, token_of)  # (T k, H)
        scale = weights.flatten().index_select(0, order).to(x.dtype)[:, None]
        out = torch.zeros_like(x)
        start = 0
        for expert, n in zip(self.experts, counts):
            if n:
                chunk = slice(start, start + n)
                out.index_add_(0, token_of[chunk], expert.forward(rows[chunk]) * scale[chunk])
                start += n
        return out

    def _mix_one_token(self, x: torch.Tensor, weights: list[float], experts: list[int]) -> torch.Tensor:
        """The decode step's single token without the grouping ops (a fixed cost per layer): its experts
        added in ascending order, as the grouped path (and transformers) adds them; each expert's fresh
        output scaled and added in place (one op, no temporary, per expert). Experts held as GGUF
        panels run all at once in one kernel (quant/gguf/modules.py moe_token), the same sums."""
        chosen = sorted(zip(experts, weights))
        panels = self._panel_experts()
        if panels is not None and x.dtype == torch.float32 and x.device.type == "cpu" and x.is_contiguous():
            kinds, fields = panels
            return moe_token(x, kinds, [fields[e] for e, _ in chosen], [w for _, w in chosen])
        out: torch.Tensor | None = None
        for expert, weight in chosen:
            y = self.experts[expert].forward(x)
            out = y.mul_(weight) if out is None else out.add_(y, alpha=weight)
        assert out is not None  # top_k >= 1 experts
        return out

    def _panel_experts(self) -> tuple[tuple[int, int], list[tuple[list, list]]] | None:
        """Where every expert is a plain gated SiLU MLP whose gate_up and down weights are GGUF panel
        tensors without bias, of one type each across the experts: (those two types, each
        expert's (gate_up, down) panel fields); else None. Found once (the weights are loaded)."""
        if self._panels_found:
            return self._panels
        self._panels_found = True
        found: list[tuple[tuple[int, list], tuple[int, list]]] = []
        for expert in self.experts:
            if type(expert) is not GatedMLP or expert.act is not F.silu:
                return None
            gate_up, down = expert.gate_up_proj, expert.down_proj
            if not isinstance(gate_up, GGMLLinear) or not isinstance(down, GGMLLinear) or not gate_up.pairs_gate_up:
                return None
            gate_up_fields, down_fields = gate_up.panel_fields(), down.panel_fields()
            if gate_up_fields is None or down_fields is None:
                return None
            found.append((gate_up_fields, down_fields))
        kinds = {(g[0], d[0]) for g, d in found}
        if len(kinds) != 1:
            return None
        self._panels = (kinds.pop(), [(g[1], d[1]) for g, d in found])
        return self._panels


class MoeForCausalLM(LlamaForCausalLM):
    """Qwen2-MoE and Qwen3-MoE (checkpoint names ``mlp.gate``, ``mlp.experts.N.{gate,up,down}_proj``,
    ``mlp.shared_expert*``): Llama's forward with a SparseMoeBlock as the MLP of the sparse layers."""

    replayable_layers = False  # a one-token step picks its experts in Python (.tolist())

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        for i in cfg.moe.sparse_layers if cfg.moe is not None else ():  # none: every layer dense
            self.model.layers[i].mlp = SparseMoeBlock(cfg)


class MixtralForCausalLM(MoeForCausalLM):
    """Mixtral: every layer sparse; its checkpoints name the block ``block_sparse_moe`` and the
    expert matrices w1 (gate), w3 (up), w2 (down)."""

    packed_modules_mapping: ClassVar[dict[str, tuple[str, str | None]]] = LlamaForCausalLM.packed_modules_mapping | {
        "block_sparse_moe": ("mlp", None),
        "w1": ("gate_up_proj", "gate"),
        "w3": ("gate_up_proj", "up"),
        "w2": ("down_proj", None),
    }


class OlmoeDecoderLayer(LlamaDecoderLayer):
    """Llama's pre-norm layer with OLMo 2's attention (q/k RMS-normed over the whole projection)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        self.self_attn = Olmo2Attention(cfg)


class OlmoeForCausalLM(MoeForCausalLM):
    """OLMoE: every layer sparse (64 experts, top-8, not renormalized in the released model)."""

    decoder_layer = OlmoeDecoderLayer
