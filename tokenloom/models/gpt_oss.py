"""gpt-oss (``GptOssForCausalLM``, GGUF ``gpt-oss``): OpenAI's open-weight mixture of experts.

Llama's pre-norm layer (models/llama.py) with, as transformers' GptOssForCausalLM computes it:
- attention with q/k/v/o biases and a learned sink logit per head: each head's softmax runs over
  its scores and the sink, and the sink's share is dropped (AttentionShape.sinks; every backend
  of the attention op serves it); sliding-window and full layers alternate, the first sliding;
  YaRN rope without truncated correction bounds;
- every MLP a mixture (models/moe.py): a router with a bias, a softmax over the top-k logits
  (the chosen experts' probabilities renormalized: the same weights), experts whose gate and up
  rows carry biases and meet in a clamped SwiGLU (layers/mlp.py ClampedSwiGLUMLP).

Checkpoints stack the experts: HF float folders as (experts, hidden, 2 intermediate) with gate
and up interleaved by column, HF MXFP4 folders as 4-bit blocks and e8m0 scales, GGUF files as
(experts, rows, cols) blocks. ``checkpoint_tensors`` splits them per expert; MXFP4 blocks stay
MXFP4 (GGML type MXFP4, the GGUF kernels' layout), re-laid from HF's nibble order where needed.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import Any, ClassVar

import torch
from torch import nn

from tokenloom.attention.backend import StepAttention
from tokenloom.models.config import ModelConfig
from tokenloom.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM
from tokenloom.models.moe import MoeForCausalLM
from tokenloom.quant.gguf.mxfp4 import MXFP4, from_hf_blocks

# model.layers.N.mlp.experts.{gate_up_proj, down_proj}[_bias | _blocks | _scales]
_STACKED = re.compile(r"(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)(_bias|_blocks|_scales)?")


class GptOssAttention(LlamaAttention):
    """Llama's attention (q/k/v/o biases by config) with a sink logit per head: (heads,)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        self.sinks = nn.Parameter(torch.empty(cfg.num_heads))

    def forward(self, x: torch.Tensor, attend: StepAttention, layer: int) -> torch.Tensor:
        """x (T, hidden) -> (T, hidden); writes this layer's keys/values of the step's tokens."""
        return self.o_proj.forward(attend(layer, self.qkv_proj.forward(x), self.norms, self.sinks))


class GptOssDecoderLayer(LlamaDecoderLayer):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        self.self_attn = GptOssAttention(cfg)


class GptOssForCausalLM(MoeForCausalLM):
    """Loads HF ``GptOssForCausalLM`` folders (float or MXFP4 experts) and GGUF ``gpt-oss`` files."""

    decoder_layer: ClassVar[type[nn.Module]] = GptOssDecoderLayer
    packed_modules_mapping: ClassVar[dict[str, tuple[str, str | None]]] = LlamaForCausalLM.packed_modules_mapping | {
        "router": ("gate", None),
    }

    @classmethod
    def stored_block_types(cls, config: ModelConfig, names: Iterable[str]) -> dict[str, int] | None:
        """Each expert matrix of a stacked `_blocks` tensor (an MXFP4 folder's): MXFP4."""
        assert config.moe is not None  # gpt-oss is a mixture
        found: dict[str, int] = {}
        for name in names:
            m = _STACKED.fullmatch(name)
            if m is None or m.group(3) != "_blocks":
                continue
            prefix, kind = m.group(1), m.group(2)
            parts = ("down_proj",) if kind == "down_proj" else ("gate_proj", "up_proj")
            found |= {f"{prefix}.{e}.{p}.weight": MXFP4 for e in range(config.moe.num_experts) for p in parts}
        return found or None

    def checkpoint_tensors(self, tensors: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
        """Stacked expert tensors split into one (name, tensor) per expert, in nn.Linear's layout;
        an MXFP4 tensor's blocks and scales are paired whichever comes first (a sharded folder may
        split them), then given as one MXFP4 GGMLTensor per expert."""
        pending: dict[tuple[str, str], Any] = {}  # (stacked name, "_blocks" or "_scales") -> the half read
        for name, tensor in tensors:
            m = _STACKED.fullmatch(name)
            if m is None:
                yield name, tensor
                continue
            prefix, kind, suffix = m.groups()
            if suffix in ("_blocks", "_scales"):  # a pair, in either order (shards may split it)
                other = (f"{prefix}.{kind}", "_scales" if suffix == "_blocks" else "_blocks")
                if other not in pending:
                    pending[(f"{prefix}.{kind}", suffix)] = tensor
                    continue
                blocks, scales = (tensor, pending.pop(other)) if suffix == "_blocks" else (pending.pop(other), tensor)
                experts = from_hf_blocks(blocks, scales)  # per expert (rows, in) MXFP4
            else:
                experts = [t.t() if suffix is None else t for t in tensor]  # (rows, in) or (rows,) each
            part = "bias" if suffix == "_bias" else "weight"
            for e, t in enumerate(experts):
                if kind == "down_proj":
                    yield f"{prefix}.{e}.down_proj.{part}", t
                else:  # gate and up interleaved, row by row
                    yield f"{prefix}.{e}.gate_proj.{part}", _every_other_row(t, 0)
                    yield f"{prefix}.{e}.up_proj.{part}", _every_other_row(t, 1)
        if pending:
            missing = [f"{stacked}{'_scales' if half == '_blocks' else '_blocks'}" for stacked, half in sorted(pending)]
            raise ValueError(f"the checkpoint's MXFP4 tensors lack {', '.join(missing)}")


def _every_other_row(t, first: int):
    """Rows first, first + 2, ... of a (rows, ...) tensor or GGML block tensor."""
    if isinstance(t, torch.Tensor):
        return t[first::2]
    return t.rows(torch.arange(first, t.shape[0], 2))
