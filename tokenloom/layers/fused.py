"""Fused float32 CPU versions of the decoder's glue (``csrc/fused_cpu.cpp``): RMSNorm (alone
or with the residual add before it), rotate-half RoPE and silu(gate) * up, each one op
instead of two to six; and the greedy pick (row argmax) over the logits.

At batch 1 a decode step is ~30 layers x ~35 small torch ops, and their dispatch
costs a measurable share of the step once the matmuls are fast (quantized). Used
only where ``enabled(x)``: float32 on the CPU with the kernels compiled; everything
else (bf16, fp16, CUDA, no compiler) takes the torch ops in layers.py.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tokenloom.kernels import native

_SOURCE = Path(__file__).parent / "csrc" / "fused_cpu.cpp"


_built: bool | None = None


def build() -> bool:
    """Compile and register the ops (once per process); False where they cannot be."""
    global _built
    if _built is None:
        _built = native.load(_SOURCE, "fused decoder ops")
    return _built


def built() -> bool:
    """The ops are compiled and registered (built on first use)."""
    return _built or build()


def enabled(x: torch.Tensor) -> bool:
    """The fused ops take x: float32 on the CPU, ops compiled (checked on every layer: kept cheap)."""
    return x.dtype == torch.float32 and x.device.type == "cpu" and (_built or build())


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x (T, H) -> w * x / sqrt(mean(x^2) + eps)."""
    return torch.ops.tokenloom_fused.rms_norm(x, weight, eps)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual (T, H) -> (rms_norm(residual + x), residual + x)."""
    return torch.ops.tokenloom_fused.add_rms_norm(x, residual, weight, eps)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (T, heads, head_dim), cos/sin (T, 1, rotary_dim <= head_dim) -> (T, heads, head_dim), the
    first rotary_dim dims of each head rotated, the rest copied."""
    return torch.ops.tokenloom_fused.rope(x, cos, sin)


def row_argmax(x: torch.Tensor) -> torch.Tensor:
    """x (B, V) with unit-stride rows -> (B,) int64: the first index of each row's maximum,
    NaN counting as the maximum (torch.argmax's result)."""
    return torch.ops.tokenloom_fused.row_argmax(x)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """(T, 2I) = [gate | up] -> silu(gate) * up (T, I)."""
    return torch.ops.tokenloom_fused.silu_mul(gate_up)
