"""Tensor parallelism's plan for one rank: its model's shapes and its share of each checkpoint tensor.

Megatron's split, as vLLM runs it: q/k/v and gate/up are column-parallel (each rank holds a
contiguous range of heads or of the intermediate size), o_proj and down_proj row-parallel (the
matching input columns; their partial outputs are summed by one all-reduce, layers.py), the
embedding and LM head vocab-parallel (each rank a range of ceil(V / N) rows, the last padded
with zeros). KV heads are split where there are at least N of them; where there are fewer each
rank keeps the one its query heads read (replicated). Norms, routers and rotary tables are
replicated. A row-parallel bias is added once: rank 0 keeps it, the others hold zeros.

Each rank's model is built from ``local_config`` (the same code as one process, with 1/N of
the heads and of the intermediate and vocabulary sizes), and ``narrow`` cuts each checkpoint
tensor to that rank's share before it is copied in, so a rank reads and holds only its share.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
from typing import cast

import torch

from tokenloom.models.config import ModelConfig
from tokenloom.quant.gguf.tensor import GGMLTensor

COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "w1", "w3")
ROW_PARALLEL = ("o_proj", "down_proj", "w2")
VOCAB_PARALLEL = ("embed_tokens", "lm_head")
# the classes whose layers are exactly Llama's or the MoE blocks' (qkv_proj, o_proj, gate_up_proj,
# down_proj, a router): OLMo 2 / OLMoE norm q and k over the whole projection, Gemma scales and
# soft-caps, Phi-3 stores q/k/v fused, GPT-2 and StableLM name theirs otherwise.
TENSOR_PARALLEL_CLASSES = ("LlamaForCausalLM", "MoeForCausalLM", "MixtralForCausalLM")
_GRANITE = "its multipliers (embeddings, residual, softmax, logits) are not applied on split ranks yet"
_UNSPLIT_REASONS = {
    "DeepseekForCausalLM": "its latent attention (one latent shared by every head) has no split across ranks yet",
    "GptOssForCausalLM": "its attention sinks and clamped experts have no split across ranks yet",
    "GraniteForCausalLM": _GRANITE,
    "GraniteMoeForCausalLM": _GRANITE,
    "GraniteMoeHybridForCausalLM": "its Mamba-2 layers' per-sequence state has no split across ranks yet",
    "Qwen3NextForCausalLM": "its Gated DeltaNet layers' per-sequence state has no split across ranks yet",
}


class TensorParallelError(ValueError):
    """A model that cannot be split over this many ranks, or a tensor that cannot be cut."""


def unsplit_error(kind: str, config: ModelConfig, model_class: type) -> TensorParallelError:
    """The error for a model `kind` ("tensor" or "pipeline") parallelism does not split: which
    families it does, this one's architecture, and why not."""
    reason = _UNSPLIT_REASONS.get(
        model_class.__name__, "its layers (their own norms and attention) have no split across ranks yet"
    )
    return TensorParallelError(
        f"{kind} parallelism is implemented for Llama, Mistral, SmolLM3, Qwen2/3 and their MoE models "
        f"(Qwen2-MoE, Qwen3-MoE, Mixtral), not {config.architecture}: {reason}; run it in one process"
    )


@dataclass(frozen=True)
class TensorShard:
    """Rank `rank` of `size` tensor-parallel ranks."""

    rank: int
    size: int

    def check(self, config: ModelConfig, model_class: type) -> None:
        """TensorParallelError naming what does not divide, or the architecture that is not split."""
        if model_class.__name__ not in TENSOR_PARALLEL_CLASSES:
            raise unsplit_error("tensor", config, model_class)
        sizes = {"num_attention_heads": config.num_heads, "intermediate_size": config.intermediate_size}
        if config.moe is not None:
            sizes["moe intermediate_size"] = config.moe.intermediate_size
            if config.moe.shared_intermediate_size:
                sizes["shared_expert_intermediate_size"] = config.moe.shared_intermediate_size
        bad = [f"{name} {value}" for name, value in sizes.items() if value % self.size]
        kv = config.num_kv_heads
        if kv % self.size and self.size % kv:
            bad.append(f"num_key_value_heads {kv} (or be a multiple of it)")
        if bad:
            raise TensorParallelError(f"--tensor-parallel-size {self.size} must divide {', '.join(bad)}")

    def kv_heads(self, config: ModelConfig) -> tuple[int, int]:
        """(first, count) of the KV heads this rank holds."""
        kv = config.num_kv_heads
        if kv >= self.size:
            return self.rank * (kv // self.size), kv // self.size
        return self.rank * kv // self.size, 1  # the head this rank's query heads read

    def vocab_rows(self, config: ModelConfig) -> tuple[int, int]:
        """(first, count) of the vocabulary rows this rank holds (count: the padded share)."""
        share = math.ceil(config.vocab_size / self.size)
        return self.rank * share, share

    def local_config(self, config: ModelConfig) -> ModelConfig:
        """The config this rank's model is built from: 1/N of the heads and sizes."""
        moe = config.moe
        if moe is not None:
            moe = dataclasses.replace(
                moe,
                intermediate_size=moe.intermediate_size // self.size,
                shared_intermediate_size=moe.shared_intermediate_size // self.size,
            )
        return dataclasses.replace(
            config,
            num_heads=config.num_heads // self.size,
            num_kv_heads=self.kv_heads(config)[1],
            intermediate_size=config.intermediate_size // self.size,
            vocab_size=self.vocab_rows(config)[1],
            moe=moe,
        )

    def narrow(self, name: str, tensor: torch.Tensor | GGMLTensor, config: ModelConfig) -> torch.Tensor | GGMLTensor:
        """Checkpoint tensor `name` (HF naming) -> this rank's share of it (a view where it can be).
        GGUF blocks stay blocks: rows are cut anywhere, input columns at block boundaries only."""
        module, kind = _module_and_kind(name)
        if module in VOCAB_PARALLEL:
            return self._vocab_share(tensor, config)
        if module in ("k_proj", "v_proj"):
            first, count = self.kv_heads(config)
            return _cut(tensor, 0, first * config.head_dim, count * config.head_dim, name)
        if module in COLUMN_PARALLEL:
            return self._even_share(tensor, 0, name)
        if module in ROW_PARALLEL:
            if kind == "bias":
                return tensor if self.rank == 0 else torch.zeros_like(cast(torch.Tensor, tensor))  # biases: float
            return self._even_share(tensor, 1, name)
        return tensor

    def _even_share(self, tensor, dim: int, name: str):
        size = tensor.shape[dim]
        if size % self.size:
            raise TensorParallelError(
                f"checkpoint tensor {name!r}: dimension {dim} ({size}) does not split over {self.size} ranks"
            )
        return _cut(tensor, dim, self.rank * (size // self.size), size // self.size, name)

    def _vocab_share(self, tensor, config: ModelConfig):
        first, share = self.vocab_rows(config)
        rows = _cut(tensor, 0, first, max(0, min(share, tensor.shape[0] - first)), "vocabulary rows")
        if rows.shape[0] == share:
            return rows
        if isinstance(rows, GGMLTensor):
            return rows.padded_rows(share)
        padded = torch.zeros((share, *tensor.shape[1:]), dtype=tensor.dtype)
        padded[: rows.shape[0]] = rows
        return padded


def _cut(tensor, dim: int, start: int, count: int, name: str):
    """tensor's [start, start + count) along `dim`; GGUF blocks cut as blocks."""
    if not isinstance(tensor, GGMLTensor):
        return tensor.narrow(dim, start, count)
    if dim == 0:
        return tensor.rows(slice(start, start + count))
    try:
        return tensor.columns(start, count)
    except ValueError as e:
        raise TensorParallelError(
            f"checkpoint tensor {name!r}: {e}, so its {tensor.type_name} blocks cannot be "
            "split between ranks as stored; load the GGUF file with --dtype float32"
        ) from e


def _module_and_kind(name: str) -> tuple[str, str]:
    """ "model.layers.3.self_attn.q_proj.weight" -> ("q_proj", "weight")."""
    parts = re.split(r"\.", name)
    return (parts[-2], parts[-1]) if len(parts) >= 2 else (name, "")
