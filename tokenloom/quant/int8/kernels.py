"""The compiled int8/int4 CPU kernels (``csrc/quant_cpu.cpp``), built on first use (see
tokenloom.kernels.native). Where they cannot be, ``available()`` is False and QuantizedLinear
falls back to dequantize + matmul: correct, slower.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tokenloom.kernels import native

_SOURCE = Path(__file__).parent / "csrc" / "quant_cpu.cpp"

_BUILDS = (("avx512vnni", "tokenloom_quant_vnni"), ("avx2", "tokenloom_quant"))


def _ops():
    """The fastest build this CPU runs: AVX-512 VNNI (dpbusd), else AVX2; None if neither builds."""
    return native.fastest(_SOURCE, "int8/int4 CPU kernels", _BUILDS)


def available() -> bool:
    """True once the kernels are compiled and registered (compiles on the first call)."""
    return _ops() is not None


def bind(w, bias: torch.Tensor | None, panel_layout: bool, silu_mul: bool = False):
    """``x (M, K) float32 contiguous -> (M, N)`` for QuantizedTensor `w` (row or panel layout) and
    float32 `bias`: the op looked up once, for callers on every layer's forward. With `silu_mul`
    (panel layout only; `w` a gate_up weight, gate rows first): silu(gate) * up, (M, N / 2)."""
    ops = _ops()
    if panel_layout:
        op = (ops.panel_linear_int8 if w.bits == 8 else ops.panel_linear_int4).default
        if w.bits == 8:
            return lambda x: op(x, w.data, w.scales, w.group_size, bias, silu_mul)
        return lambda x: op(x, w.data, w.scales, w.offsets, w.group_size, bias, silu_mul)
    if silu_mul:
        raise ValueError("silu_mul runs in the panel kernels only")
    op = (ops.linear_int8 if w.bits == 8 else ops.linear_int4).default
    if w.bits == 8:
        return lambda x: op(x, w.data, w.scales, w.group_size, bias)
    return lambda x: op(x, w.data, w.scales, w.offsets, w.group_size, bias)


def panel_rows(w, index: torch.Tensor) -> torch.Tensor:
    """Rows `index` (1-D int64) of panel-layout QuantizedTensor `w`, dequantized: float32 (L, K), the
    same values as ``panels.rows(w, index).dequantize()``; an index out of range is an error."""
    return _ops().panel_rows(w.data, w.scales, w.offsets, w.group_size, index.to(torch.int64))


def panels_available() -> bool:
    """A build with the panel kernels (AVX-512 VNNI, or AVX2) runs here."""
    ops = _ops()
    return ops is not None and hasattr(ops, "panel_linear_int4")
