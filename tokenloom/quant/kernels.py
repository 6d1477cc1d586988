"""The compiled int8/int4 CPU kernels (``csrc/quant_cpu.cpp``), built on first use (see
tokenloom.native). Where they cannot be, ``available()`` is False and QuantizedLinear
falls back to dequantize + matmul: correct, slower.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tokenloom import native

_SOURCE = Path(__file__).parent / "csrc" / "quant_cpu.cpp"
_cpu_has_avx2 = native.cpu_has_avx2


def available() -> bool:
    """True once the kernels are compiled and registered (compiles on the first call)."""
    return native.load(_SOURCE, "int8/int4 CPU kernels")


def linear_int8(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, group: int,
                bias: torch.Tensor | None) -> torch.Tensor:
    """x (M, K) float32 contiguous -> (M, N); w = q * scales (see formats.py)."""
    return torch.ops.tokenloom_quant.linear_int8(x, q, scales, group, bias)


def linear_int4(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor, group: int,
                bias: torch.Tensor | None) -> torch.Tensor:
    """x (M, K) float32 contiguous -> (M, N); w = q * scales + offsets (see formats.py)."""
    return torch.ops.tokenloom_quant.linear_int4(x, q, scales, offsets, group, bias)
