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


_BUILDS = (("avx512vnni", "tokenloom_quant_vnni"), ("avx2", "tokenloom_quant"))


def _ops():
    """The fastest build this CPU runs: AVX-512 VNNI (dpbusd), else AVX2; None if neither builds."""
    return native.fastest(_SOURCE, "int8/int4 CPU kernels", _BUILDS)


def available() -> bool:
    """True once the kernels are compiled and registered (compiles on the first call)."""
    return _ops() is not None


def linear_int8(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, group: int,
                bias: torch.Tensor | None) -> torch.Tensor:
    """x (M, K) float32 contiguous -> (M, N); w = q * scales (see formats.py)."""
    return _ops().linear_int8(x, q, scales, group, bias)


def linear_int4(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor, group: int,
                bias: torch.Tensor | None) -> torch.Tensor:
    """x (M, K) float32 contiguous -> (M, N); w = q * scales + offsets (see formats.py)."""
    return _ops().linear_int4(x, q, scales, offsets, group, bias)


def bind(w, bias: torch.Tensor | None, panel_layout: bool):
    """``x (M, K) float32 contiguous -> (M, N)`` for QuantizedTensor `w` (row or panel layout) and
    float32 `bias`: the op looked up once, for callers on every layer's forward."""
    ops = _ops()
    if panel_layout:
        op = (ops.panel_linear_int8 if w.bits == 8 else ops.panel_linear_int4).default
    else:
        op = (ops.linear_int8 if w.bits == 8 else ops.linear_int4).default
    if w.bits == 8:
        return lambda x: op(x, w.data, w.scales, w.group_size, bias)
    return lambda x: op(x, w.data, w.scales, w.offsets, w.group_size, bias)


def panels_available() -> bool:
    """The AVX-512 VNNI build, which has the panel kernels, runs here."""
    ops = _ops()
    return ops is not None and hasattr(ops, "panel_linear_int4")


def panel_linear(x: torch.Tensor, w, bias: torch.Tensor | None) -> torch.Tensor:
    """x (M, K) float32 contiguous, w a QuantizedTensor in the panel layout (panels.py) -> (M, N)."""
    return bind(w, bias, panel_layout=True)(x)
