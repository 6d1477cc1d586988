"""The gated MLP (down(act(gate(x)) * up(x))) and the activations configs name.

Matches HF transformers' arithmetic (op order and the float32 upcasts): parity with transformers
is tested to 1e-4 in logprobs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenloom.kernels import triton as triton_kernels
from tokenloom.layers import fused
from tokenloom.layers.custom_op import CustomOp
from tokenloom.layers.prepacked import PanelLinear
from tokenloom.quant.gguf.modules import GGMLLinear
from tokenloom.quant.int8.modules import QuantizedLinear


def activation(name: str):
    """The elementwise activation a config names (HF spelling)."""
    if name == "silu":
        return F.silu
    if name in ("gelu_new", "gelu_pytorch_tanh"):
        return lambda x: F.gelu(x, approximate="tanh")
    if name == "gelu":
        return F.gelu
    if name == "relu":
        return F.relu
    raise ValueError(f"activation {name!r} is not supported")


class GatedMLP(CustomOp):
    """down(act(gate(x)) * up(x)) with gate and up fused into one matmul: x (T, hidden) -> (T, hidden).

    On the CPU with silu, act * up runs in the gate_up call where its weight is panel-packed
    (float32: in the kernel's epilogue, the (T, 2 intermediate) product never reaching memory;
    int8/int4 and GGUF panels: after the product, in the same call), else as one fused op after
    the matmul."""

    def __init__(self, hidden: int, intermediate: int, bias: bool, act: str) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden, 2 * intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)
        self.act = activation(act)
        self.intermediate = intermediate

    def cpu_takes(self, x: torch.Tensor) -> bool:
        return self.act is F.silu

    def forward_cuda(self, x: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up in one Triton kernel between the two matmuls."""
        gate_up = self.gate_up_proj(x)  # (T, 2 intermediate)
        if self.act is F.silu and gate_up.dim() == 2 and gate_up.stride(1) == 1 and triton_kernels.usable(gate_up):
            from tokenloom.kernels.triton.silu_mul import silu_mul

            return self.down_proj(silu_mul(gate_up))
        return self._down_of(gate_up)

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        return self._down_of(self.gate_up_proj(x))

    def _down_of(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.split(self.intermediate, dim=-1)  # each (T, intermediate)
        return self.down_proj(self.act(gate) * up)

    def forward_cpu(self, x: torch.Tensor) -> torch.Tensor:
        proj = self.gate_up_proj
        if isinstance(proj, PanelLinear | GGMLLinear | QuantizedLinear) and proj.pairs_gate_up:
            return self.down_proj.forward(proj.silu_mul(x))
        gate_up = proj.forward(x)  # (T, 2 intermediate)
        if gate_up.dim() == 2 and gate_up.stride(1) == 1:
            return self.down_proj.forward(fused.silu_mul(gate_up))
        return self._down_of(gate_up)


class ClampedSwiGLUMLP(GatedMLP):
    """gpt-oss's expert: down((clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g)), with
    g = min(gate, limit), gate and up (with their biases) from one fused matmul as in GatedMLP:
    x (T, hidden) -> (T, hidden). transformers' GptOssExperts order of ops."""

    def __init__(self, hidden: int, intermediate: int, alpha: float, limit: float) -> None:
        super().__init__(hidden, intermediate, True, "silu")
        self.alpha, self.limit = alpha, limit

    def cpu_takes(self, x: torch.Tensor) -> bool:
        return False  # the fused kernels compute silu(gate) * up, not this

    def forward_cuda(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_native(x)

    def _down_of(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.split(self.intermediate, dim=-1)  # each (T, intermediate)
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return self.down_proj((up + 1) * (gate * torch.sigmoid(gate * self.alpha)))
