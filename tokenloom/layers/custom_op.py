"""CustomOp: a layer with one implementation per backend, chosen per call (vLLM's CustomOp shape).

A model calls ``op(x)`` (or one of the op's other entry points) and never asks which
backend runs. ``forward_native`` is plain torch ops (any device, any dtype: the reference);
``forward_cpu`` calls the compiled float32 CPU kernels (layers/fused.py) and runs where
``cpu_takes`` says they take the input; ``forward_cuda`` is where CUDA kernels plug in
(native until one exists). Each backend must give the same numbers as the native one
within float32 rounding (tests/layers/test_layers.py).
"""

from __future__ import annotations

import torch
from torch import nn

from tokenloom.layers import fused

_FLOAT32 = torch.float32


class CustomOp(nn.Module):
    """Each call picks the backend from the input's device and dtype, then ``cpu_takes``."""

    _on_cpu_kernels: bool | None = None  # the CPU kernels are built (looked up at the first call)

    def forward(self, x: torch.Tensor, *args):
        if self.uses_cpu_kernels(x) and self.cpu_takes(x):
            return self.forward_cpu(x, *args)
        return (self.forward_cuda if x.is_cuda else self.forward_native)(x, *args)

    def uses_cpu_kernels(self, x: torch.Tensor) -> bool:
        """x is a float32 CPU tensor and the kernels are built (built-ness checked once)."""
        if self._on_cpu_kernels is None:
            self._on_cpu_kernels = fused.built()
        return self._on_cpu_kernels and x.dtype is _FLOAT32 and x.is_cpu

    def cpu_takes(self, x: torch.Tensor) -> bool:
        """Beyond dtype and device: the float32 CPU kernels take x's shape and layout."""
        return True

    def forward_native(self, x: torch.Tensor, *args):
        raise NotImplementedError

    def forward_cpu(self, x: torch.Tensor, *args):
        return self.forward_native(x, *args)

    def forward_cuda(self, x: torch.Tensor, *args):
        return self.forward_native(x, *args)
