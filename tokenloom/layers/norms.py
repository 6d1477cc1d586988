"""RMSNorm, with the residual add fused in (``add_forward``) on the CPU and GPU paths.

Matches HF transformers' arithmetic (op order and the float32 upcasts): parity with transformers
is tested to 1e-4 in logprobs.
"""

from __future__ import annotations

import torch
from torch import nn

from tokenloom.kernels import triton as triton_kernels
from tokenloom.layers import fused
from tokenloom.layers.custom_op import CustomOp


class RMSNorm(CustomOp):
    """y = w * x / sqrt(mean(x^2) + eps), computed in float32 like HF Llama. Entry points:
    ``forward(x)`` and ``add_forward(x, residual)`` (the residual update, then the norm)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def cpu_takes(self, x: torch.Tensor) -> bool:
        return x.dim() == 2 and x.stride(1) == 1

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)

    def forward_cpu(self, x: torch.Tensor) -> torch.Tensor:
        return fused.rms_norm(x, self.weight, self.eps)

    def forward_cuda(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and x.stride(1) == 1 and triton_kernels.usable(x):
            from tokenloom.kernels.triton.rms_norm import rms_norm

            return rms_norm(x, self.weight, self.eps)
        return self.forward_native(x)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x, residual (T, H) -> (norm(residual + x), residual + x)."""
        if x.dim() == 2 and x.stride(1) == 1 and residual.stride(-1) == 1:
            if self.uses_cpu_kernels(x):
                return fused.add_rms_norm(x, residual, self.weight, self.eps)  # add_forward_cpu
            if x.is_cuda and triton_kernels.usable(x):
                from tokenloom.kernels.triton.rms_norm import add_rms_norm

                return add_rms_norm(x, residual, self.weight, self.eps)
        return self.add_forward_native(x, residual)

    def add_forward_native(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        total = residual + x
        return self(total), total

    def add_forward_cpu(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return fused.add_rms_norm(x, residual, self.weight, self.eps)
