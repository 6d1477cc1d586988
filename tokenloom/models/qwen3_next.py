"""Qwen3-Next (``Qwen3NextForCausalLM``, GGUF ``qwen3next``): a hybrid of Gated DeltaNet layers
(layers/gated_deltanet.py; ModelConfig.recurrent) and, every fourth layer by default, gated
attention, each layer's MLP a mixture of experts with a sigmoid-gated shared expert (models/moe.py)
or, in mlp_only_layers, a dense MLP.

What differs from Qwen3-MoE, each as transformers' Qwen3NextForCausalLM does it:
- attention's q_proj gives each head its query and a gate: the output is o_proj(attention *
  sigmoid(gate)). The gate rows are read at load into qkv_proj after q, k and v ([q | k | v | gate]);
- a quarter of each head's dims turn by rope (partial_rotary_factor);
- every RMSNorm but the DeltaNet's gated norm multiplies by (1 + w): kept as 1 + w at load (computed
  in float32 as transformers computes it on every call), so they run as the model's other norms;
- the recurrent layers keep a per-sequence state, not keys and values (kv_cache/recurrent.py).

A checkpoint's multi-token-prediction weights (``mtp.*``; GGUF blocks past the model's layers) are
not run: skipped on load, said once.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Iterator
from typing import Any, ClassVar

import torch
from torch import nn

from tokenloom.attention.backend import StepAttention
from tokenloom.layers.gated_deltanet import GatedDeltaNet, ba_rows, qkvz_rows
from tokenloom.models.config import DeltaNetConfig, ModelConfig
from tokenloom.models.llama import LlamaAttention, LlamaDecoderLayer
from tokenloom.models.moe import MoeForCausalLM
from tokenloom.quant.gguf.tensor import GGMLTensor
from tokenloom.quant.int8.formats import QuantizedTensor

log = logging.getLogger("tokenloom")

_Q_PROJ = re.compile(r"(model\.layers\.\d+\.self_attn)\.q_proj\.weight")
_QKVZ = re.compile(r"(model\.layers\.\d+\.linear_attn)\.in_proj_qkvz\.weight")


class GatedAttention(LlamaAttention):
    """Llama's attention (q/k norm, GQA) whose output is scaled by sigmoid(gate) before o_proj; the
    gate is a second projection of x, held in qkv_proj after q, k and v."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        self.qkv_size = self.q_size + 2 * self.kv_size
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.qkv_size + self.q_size, bias=cfg.attention_bias)

    def forward(self, x: torch.Tensor, attend: StepAttention, layer: int) -> torch.Tensor:
        """x (T, hidden) -> (T, hidden); writes this layer's keys/values of the step's tokens."""
        qkvg = self.qkv_proj.forward(x)  # (T, q + 2 kv + q)
        out = attend(layer, qkvg[:, : self.qkv_size].contiguous(), self.norms)  # (T, q)
        return self.o_proj.forward(out.mul_(torch.sigmoid(qkvg[:, self.qkv_size :])))


class Qwen3NextDecoderLayer(LlamaDecoderLayer):
    """Llama's pre-norm layer whose mixer is gated attention or, once ``make_recurrent`` ran, a
    Gated DeltaNet."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        self.self_attn = GatedAttention(cfg)
        self.recurrent = False

    def make_recurrent(self, cfg: ModelConfig) -> None:
        """Swap this layer's attention for a Gated DeltaNet (HF's ``linear_attn.*`` weights)."""
        del self.self_attn
        self.linear_attn = GatedDeltaNet(cfg)
        self.recurrent = True

    def mix(self, x: torch.Tensor, attend: StepAttention, layer: int) -> torch.Tensor:
        """x (T, hidden) -> (T, hidden) through the layer's Gated DeltaNet or attention."""
        return (self.linear_attn if self.recurrent else self.self_attn).forward(x, attend, layer)


class Qwen3NextForCausalLM(MoeForCausalLM):
    """Loads HF ``Qwen3NextForCausalLM`` checkpoints and GGUF ``qwen3next`` files (see the module doc)."""

    decoder_layer = Qwen3NextDecoderLayer
    replayable_layers = False  # a step's recurrent layers choose their path per sequence in Python
    packed_modules_mapping: ClassVar[dict[str, tuple[str, str | None]]] = MoeForCausalLM.packed_modules_mapping | {
        "o_gate": ("qkv_proj", "g"),
        "in_proj_qkv": ("in_proj", "qkv"),
        "in_proj_z": ("in_proj", "z"),
    }
    ignored_checkpoint_keys = (*MoeForCausalLM.ignored_checkpoint_keys, r"mtp\..*")

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        assert isinstance(cfg.recurrent, DeltaNetConfig)  # Qwen3-Next names its DeltaNet layers
        self.deltanet = cfg.recurrent
        for i in cfg.recurrent.layers:
            layer = self.model.layers[i]
            assert isinstance(layer, Qwen3NextDecoderLayer)  # decoder_layer above
            layer.make_recurrent(cfg)
        self._said_mtp = False

    def is_ignored_checkpoint_key(self, name: str) -> bool:
        ignored = super().is_ignored_checkpoint_key(name)
        if ignored and name.startswith("mtp.") and not self._said_mtp:
            self._said_mtp = True
            log.info("skipping mtp.*: Qwen3-Next's multi-token-prediction layer is not run")
        return ignored

    def shard_rows(self, param_name: str, shard_id: str) -> slice:
        """Llama's shards, the attention gate's rows after q, k and v, and the DeltaNet in_proj's parts."""
        c = self.config
        if shard_id == "g":
            q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
            return slice(q + 2 * kv, 2 * q + 2 * kv)
        if shard_id in ("qkv", "z"):
            mixer = self.get_submodule(param_name.rsplit(".", 2)[0])
            assert isinstance(mixer, GatedDeltaNet)  # the in_proj shards are a DeltaNet's
            return mixer.shard_rows(shard_id)
        return super().shard_rows(param_name, shard_id)

    def transform_checkpoint_tensor(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """(1 + w) norms: keep 1 + w, computed in float32 as transformers does per call (not the
        DeltaNet's gated norm, which multiplies by w)."""
        if name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
            return 1.0 + tensor.float()
        return tensor

    def checkpoint_rows(self, name: str) -> torch.Tensor | None:
        """in_proj_ba's rows from per-key-head groups to [b | a]."""
        return ba_rows(self.deltanet) if name.endswith("linear_attn.in_proj_ba.weight") else None

    def checkpoint_tensors(self, tensors: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
        """Attention's q_proj (per head [query, gate]) split into q_proj and o_gate; a DeltaNet's
        in_proj_qkvz (per key head [q, k, v, z]) split into in_proj_qkv ([q | k | v]) and in_proj_z,
        as llama.cpp's converter splits it (a GGUF file stores those two)."""
        c = self.config
        gate_rows = torch.arange(2 * c.num_heads * c.head_dim, device="cpu").view(c.num_heads, 2, c.head_dim)
        qkv_rows, z_rows = qkvz_rows(self.deltanet)
        for name, tensor in tensors:
            if m := _Q_PROJ.fullmatch(name):
                yield f"{m.group(1)}.q_proj.weight", _rows(tensor, gate_rows[:, 0].reshape(-1))
                yield f"{m.group(1)}.o_gate.weight", _rows(tensor, gate_rows[:, 1].reshape(-1))
            elif m := _QKVZ.fullmatch(name):
                yield f"{m.group(1)}.in_proj_qkv.weight", _rows(tensor, qkv_rows)
                yield f"{m.group(1)}.in_proj_z.weight", _rows(tensor, z_rows)
            else:
                yield name, tensor


def _rows(tensor: Any, index: torch.Tensor) -> Any:
    """Rows `index` of a float tensor or of stored blocks (GGUF or int8: rows are independent)."""
    return tensor.rows(index) if isinstance(tensor, (GGMLTensor, QuantizedTensor)) else tensor[index]
