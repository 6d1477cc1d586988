"""Float32 CPU linear layers with their weight prepacked once at load: same forward contract
as nn.Linear, ``x (..., in) -> (..., out)``, and swapped in by ``prepack_linears``.

Two layouts, picked per CPU:
- PanelLinear (AVX-512 and AVX2 CPUs): tokenloom's own kernel (``csrc/panel_linear.cpp``) over
  panels of 16 output columns; fastest at decode sizes and batch-invariant bit for bit.
- PackedLinear (where the panel kernel cannot be built): oneDNN's blocked layout through
  ``mkldnn._linear_pointwise``.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from tokenloom.kernels import native

_PANEL_SOURCE = Path(__file__).parent / "csrc" / "panel_linear.cpp"
_PANEL_BUILDS = (("avx512", "tokenloom_panel_avx512"), ("avx2", "tokenloom_panel_avx2"))


def panel_ops():
    """The panel kernel's ops for the fastest build this CPU runs (AVX-512, else AVX2), built
    once; None where neither can be."""
    return native.fastest(_PANEL_SOURCE, "float32 linear panel kernel", _PANEL_BUILDS)


def build() -> bool:
    """Build (once) and load the panel kernel; False where this CPU or toolchain cannot."""
    return panel_ops() is not None


def _float32_cpu(linear: nn.Linear) -> bool:
    return linear.weight.device.type == "cpu" and linear.weight.dtype == torch.float32


class _PrepackedLinear(nn.Module):
    """Shared bookkeeping: sizes, the bias, and nn.Linear's repr."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(), requires_grad=False)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class PanelLinear(_PrepackedLinear):
    """nn.Linear over a weight packed in panels of 16 output columns, (ceil(out/16), in, 16).

    Chosen over PackedLinear wherever it builds (AVX-512 or AVX2) because decode-sized calls
    (1-64 rows) read the weight once at near DRAM bandwidth, so float32 decode runs markedly
    faster, while 128-row calls stay even with oneDNN (docs/BENCHMARKS.md, 'Measurements behind
    design choices').
    A row's output is the same bits whichever rows share the call; ``silu_mul`` (a gated
    MLP's gate_up) gives the same bits as ``forward`` followed by ``fused.silu_mul``.
    """

    def __init__(self, linear: nn.Linear) -> None:
        if not self.supports(linear):
            raise ValueError("PanelLinear needs a float32 CPU weight and an AVX2 CPU with the kernel built")
        super().__init__(linear)
        weight = linear.weight.detach()
        ops = panel_ops()
        self.register_buffer("panels", ops.pack(weight), persistent=False)
        self._linear, self._linear_silu_mul = ops.linear.default, ops.linear_silu_mul.default

    @staticmethod
    def supports(linear: nn.Linear) -> bool:
        """True for float32 CPU weights where the kernel is built."""
        return _float32_cpu(linear) and build()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._linear(x, self.panels, self.out_features, self.bias)

    @property
    def pairs_gate_up(self) -> bool:
        """A gated MLP's gate_up weight splits into gate and up halves of whole panels."""
        return self.out_features % (2 * 16) == 0

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor:
        """For a gate_up weight (gate rows, then up rows): x (..., in) -> silu(gate) * up
        (..., out / 2) in the kernel's epilogue; the same bits as forward then fused.silu_mul."""
        return self._linear_silu_mul(x, self.panels, self.bias)


class PackedLinear(_PrepackedLinear):
    """nn.Linear with its weight prepacked once in oneDNN's blocked layout; same forward contract.

    ``x (..., in) -> (..., out)`` through ``mkldnn._linear_pointwise``, which reads the
    prepacked weight directly: no per-call weight packing (what MKL's sgemm does for
    every call) and no dense<->mkldnn conversion of activations: faster than F.linear at every
    row count measured, 1 to 512 (docs/BENCHMARKS.md, 'Measurements behind design choices').
    The dense weight is dropped after packing (a tied weight stays with its embedding).
    """

    def __init__(self, linear: nn.Linear, batch_hint: int = 64) -> None:
        super().__init__(linear)
        weight = linear.weight.detach()
        self.register_buffer(
            "packed_weight", torch.ops.mkldnn._reorder_linear_weight(weight, batch_hint), persistent=False
        )

    @staticmethod
    def supports(linear: nn.Linear) -> bool:
        """True where oneDNN can take this layer: float32 weights on CPU, oneDNN built in."""
        return (
            _float32_cpu(linear)
            and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_linear_pointwise")
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")


def prepack_linears(model: nn.Module) -> None:
    """Swap every float32 CPU nn.Linear in `model` for the fastest prepacked form this CPU has."""
    swaps = [(name, mod) for name, mod in model.named_modules() if isinstance(mod, nn.Linear)]
    for name, mod in swaps:
        kind = next((k for k in (PanelLinear, PackedLinear) if k.supports(mod)), None)
        if kind is None:
            continue
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, kind(mod))
