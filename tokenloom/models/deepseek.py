"""DeepSeek-V2 and V3 (``DeepseekV2ForCausalLM``, ``DeepseekV3ForCausalLM``, GGUF ``deepseek2``).

Llama's pre-norm layer (models/llama.py) with multi-head latent attention (MLA) and, from
``first_k_dense_replace`` on, DeepSeek's mixture (models/moe.py: grouped top-k routing, V3's
sigmoid scores and correction bias, routed scaling, ungated shared experts).

MLA caches one vector a token: the rope key k_pe (shared by every head) and the normed latent c.
A head's key is [W_UK_h c, k_pe] and its value W_UV_h c. Attention runs in the latent space, as
llama.cpp and vLLM decode it ("absorbed"):

    q_h . k_h = q_pe_h . k_pe + (W_UK_h^T q_nope_h) . c          (the query absorbs W_UK)
    out_h     = W_UV_h (sum_t p_t c_t)                          (W_UV applied once, after)

so the attention op sees one kv head of [k_pe, c] (``AttentionShape.value_dim``: its tail c is the
value), queries [q_pe_h, W_UK_h^T q_nope_h] and returns each head's latent output. kv_b_proj is kept
split as llama.cpp's GGUF files store it: k_b (heads, kv_lora_rank, nope) and v_b (heads, v_dim,
kv_lora_rank). The rope dims of q and of kv_a_proj_with_mqa are read first and in rotate-half order
(``checkpoint_rows``): the scores are those of the interleaved pairs DeepSeek turns.

A V3 checkpoint's multi-token-prediction layer (``model.layers.{num_hidden_layers}``) is not run;
its tensors are skipped on load, with a log line.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Iterable, Iterator
from typing import Any, ClassVar

import torch
from torch import nn

from tokenloom.attention.backend import AttentionShape, StepAttention
from tokenloom.layers.grouped import GroupedLinear
from tokenloom.layers.norms import RMSNorm
from tokenloom.layers.rope import interleaved_to_halves
from tokenloom.models.config import MlaConfig, ModelConfig
from tokenloom.models.llama import LlamaDecoderLayer
from tokenloom.models.moe import MoeForCausalLM
from tokenloom.quant.gguf.tensor import GGMLTensor

log = logging.getLogger(__name__)

_LAYER = re.compile(r"model\.layers\.(\d+)\..*")
_KV_B = re.compile(r"(model\.layers\.\d+\.self_attn)\.kv_b_proj\.weight")


class LatentAttention(nn.Module):
    """x (T, hidden) -> (T, hidden) through MLA, the latent attended in place of per-head keys."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        mla = cfg.mla
        assert mla is not None  # a latent-attention model
        self.mla, self.num_heads = mla, cfg.num_heads
        q_size = cfg.num_heads * mla.qk_head_dim  # each head [rope, nope] (checkpoint_rows)
        if mla.q_lora_rank is None:
            self.q_proj = nn.Linear(cfg.hidden_size, q_size, bias=False)
        else:
            self.q_a_proj = nn.Linear(cfg.hidden_size, mla.q_lora_rank, bias=cfg.attention_bias)
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, 1e-6)
            self.q_b_proj = nn.Linear(mla.q_lora_rank, q_size, bias=False)
        # [k_pe, c] (checkpoint_rows puts the rope key first)
        self.kv_a_proj_with_mqa = nn.Linear(cfg.hidden_size, mla.latent_dim, bias=cfg.attention_bias)
        self.kv_a_layernorm = RMSNorm(mla.kv_lora_rank, 1e-6)
        self.k_b = GroupedLinear(cfg.num_heads, mla.qk_nope_head_dim, mla.kv_lora_rank)  # per head: nope -> latent
        self.v_b = GroupedLinear(cfg.num_heads, mla.kv_lora_rank, mla.v_head_dim)  # per head: latent -> value
        self.o_proj = nn.Linear(cfg.num_heads * mla.v_head_dim, cfg.hidden_size, bias=cfg.o_proj_bias)

    def queries(self, x: torch.Tensor) -> torch.Tensor:
        """x (T, hidden) -> q (T, heads, rope + nope)."""
        if self.mla.q_lora_rank is None:
            q = self.q_proj.forward(x)
        else:
            q = self.q_b_proj.forward(self.q_a_layernorm.forward(self.q_a_proj.forward(x)))
        return q.view(x.shape[0], self.num_heads, self.mla.qk_head_dim)

    def forward(self, x: torch.Tensor, attend: StepAttention, layer: int) -> torch.Tensor:
        """x (T, hidden) -> (T, hidden); writes this layer's latent of the step's tokens."""
        T, H, mla = x.shape[0], self.num_heads, self.mla
        rope, rank = mla.qk_rope_head_dim, mla.kv_lora_rank
        q = self.queries(x)  # (T, H, rope + nope)
        kv = self.kv_a_proj_with_mqa.forward(x)  # (T, rope + rank)
        latent = self.kv_a_layernorm.forward(kv[:, rope:])  # (T, rank)
        q_latent = self.k_b(q[..., rope:])  # (T, H, rank)
        qk = torch.cat([q[..., :rope], q_latent], dim=-1).view(T, H * mla.latent_dim)
        key = torch.cat([kv[:, :rope], latent], dim=-1)  # (T, rope + rank)
        out = attend(layer, torch.cat([qk, key], dim=1))  # (T, H rank)
        values = self.v_b(out.view(T, H, rank))  # (T, H, v_dim)
        return self.o_proj.forward(values.reshape(T, H * mla.v_head_dim))


class DeepseekDecoderLayer(LlamaDecoderLayer):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        self.self_attn = LatentAttention(cfg)


def softmax_scale(cfg: ModelConfig) -> float:
    """qk_head_dim ** -0.5, times YaRN's mscale(factor, mscale_all_dim) squared where the rope
    scales (transformers' yarn_apply_mscale)."""
    mla, rope = cfg.mla, cfg.rope
    assert mla is not None and rope is not None  # a latent-attention model with rope
    scale = mla.qk_head_dim**-0.5
    if rope.rope_type != "default" and rope.mscale_all_dim and rope.factor > 1:
        m = 0.1 * rope.mscale_all_dim * math.log(rope.factor) + 1.0
        scale *= m * m
    return scale


class DeepseekForCausalLM(MoeForCausalLM):
    """Loads HF DeepSeek-V2/V3 folders and GGUF ``deepseek2`` files (see the module doc)."""

    decoder_layer: ClassVar[type[nn.Module]] = DeepseekDecoderLayer
    packed_modules_mapping: ClassVar[dict[str, tuple[str, str | None]]] = {
        "gate_proj": ("gate_up_proj", "gate"),
        "up_proj": ("gate_up_proj", "up"),
        "shared_experts": ("shared_expert", None),
    }

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        mla = cfg.mla
        assert mla is not None  # DeepSeek attends through MLA
        self.attention_shape = AttentionShape(
            cfg.num_heads, 1, mla.latent_dim, softmax_scale(cfg), cfg.layer_windows(), value_dim=mla.kv_lora_rank
        )
        self._rows = _rope_first_rows(mla, cfg.num_heads, cfg.rope_interleaved)
        self._skipped: set[int] = set()

    def is_ignored_checkpoint_key(self, name: str) -> bool:
        """A layer past the model's (V3's multi-token-prediction layer) is skipped, said once."""
        m = _LAYER.fullmatch(name)
        if m is None or int(m.group(1)) < self.config.num_layers:
            return False
        layer = int(m.group(1))
        if layer not in self._skipped:
            self._skipped.add(layer)
            log.info("skipping layer %d: DeepSeek's multi-token-prediction layer is not run", layer)
        return True

    def checkpoint_rows(self, name: str) -> torch.Tensor | None:
        """q (q_proj or q_b_proj) with each head's rope dims first, kv_a_proj_with_mqa with the rope
        key before the latent, rope pairs turned rotate-half where the checkpoint interleaves them."""
        if name.endswith(("self_attn.q_proj.weight", "self_attn.q_b_proj.weight")):
            return self._rows[0]
        if ".self_attn.kv_a_proj_with_mqa." in name:
            return self._rows[1]
        return None

    def checkpoint_tensors(self, tensors: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
        """HF's kv_b_proj (heads (nope + v_dim), kv_lora_rank) split as llama.cpp's converter splits
        it: k_b (heads kv_lora_rank, nope), each head's block transposed, and v_b (heads v_dim,
        kv_lora_rank)."""
        mla = self.config.mla
        assert mla is not None  # DeepSeek attends through MLA
        for name, tensor in tensors:
            m = _KV_B.fullmatch(name)
            if m is None:
                yield name, tensor
                continue
            w = tensor.dequantize() if isinstance(tensor, GGMLTensor) else tensor
            heads = w.shape[0] // (mla.qk_nope_head_dim + mla.v_head_dim)
            k_b, v_b = w.view(heads, -1, w.shape[1]).split([mla.qk_nope_head_dim, mla.v_head_dim], dim=1)
            yield f"{m.group(1)}.k_b.weight", k_b.transpose(1, 2).reshape(-1, mla.qk_nope_head_dim)
            yield f"{m.group(1)}.v_b.weight", v_b.reshape(-1, w.shape[1])


def _rope_first_rows(mla: MlaConfig, heads: int, interleaved: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Row orders of (q, kv_a_proj_with_mqa): each q head [rope, nope] from [nope, rope], the kv
    projection [k_pe, c] from [c, k_pe]; rope dims into rotate-half pairs if `interleaved`."""
    rope, nope, cpu = mla.qk_rope_head_dim, mla.qk_nope_head_dim, "cpu"  # not the meta device models build on
    turn = interleaved_to_halves(rope, rope, 1) if interleaved else torch.arange(rope, device=cpu)
    head = torch.cat([nope + turn, torch.arange(nope, device=cpu)])
    q = torch.cat([head + h * (rope + nope) for h in range(heads)])
    kv = torch.cat([mla.kv_lora_rank + turn, torch.arange(mla.kv_lora_rank, device=cpu)])
    return q, kv
