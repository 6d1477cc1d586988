"""G independent linear maps, each applied to its own input: x (T, G, in) -> (T, G, out).

DeepSeek's latent attention runs one per head twice a layer (the query through k_b, the latent
output through v_b). A float weight runs as one batched matmul. A GGUF tensor of a type whose
values int8 codes with a scale (and offset) per 32 hold exactly (Q8_0, Q5_0, Q4_0, Q4_1,
IQ4_NL; quant/gguf/blocks.py) is kept so, not dequantized: decode steps (a few rows) run the
grouped kernel (``csrc/grouped_matvec.cpp``), reading a quarter of float32's bytes, one call for
every head; longer steps dequantize it for a batched matmul.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from tokenloom.kernels import native
from tokenloom.quant.gguf.tensor import GGMLTensor

_SOURCE = Path(__file__).parent / "csrc" / "grouped_matvec.cpp"
KERNEL_ROWS = 8  # steps of at most this many rows run the kernel (weights read once for all of them)


def kernel_built() -> bool:
    return native.load(_SOURCE, "grouped matrix-vector kernel")


class GroupedLinear(nn.Module):
    """`groups` maps of (out_features, in_features), stored one after another as a
    (groups out_features, in_features) weight. The loader hands it its checkpoint tensor
    (``load_weight``, as it does quantized linears): a float tensor fills ``weight``, a GGUF
    tensor of an exact int8 format fills ``codes``/``scales``/``offsets`` instead, unless
    ``keep_blocks`` is False (the file read as float)."""

    loads_own_weight = True  # quant.int8.modules.quantized_targets

    def __init__(self, groups: int, in_features: int, out_features: int) -> None:
        super().__init__()
        self.keep_blocks = True  # the loader says False where a GGUF file is read as float (dtype float32)
        self.groups, self.in_features, self.out_features = groups, in_features, out_features
        self.weight: torch.Tensor | None
        self.register_buffer("weight", torch.empty(groups * out_features, in_features))
        self.codes: torch.Tensor | None  # (G, N, K) int8
        self.scales: torch.Tensor | None  # (G, N, K / 32) float32
        self.offsets: torch.Tensor | None  # like scales, or None
        for name in ("codes", "scales", "offsets"):
            self.register_buffer(name, None)

    def load_weight(self, tensor: torch.Tensor | GGMLTensor, rows: slice | None = None) -> None:
        """Fill from a (groups out, in) checkpoint tensor: float, or GGUF blocks (kept as int8 codes
        where their type allows, else dequantized)."""
        from tokenloom.quant.gguf.blocks import EXACT_FORMATS, to_quantized
        from tokenloom.quant.int8.formats import unpack_int4

        shape = (self.groups * self.out_features, self.in_features)
        if tuple(tensor.shape) != shape:
            raise ValueError(f"has shape {tuple(tensor.shape)}, expected {shape}")
        if self.keep_blocks and isinstance(tensor, GGMLTensor) and tensor.kind in EXACT_FORMATS and kernel_built():
            q = to_quantized(tensor)
            codes = q.data if q.bits == 8 else unpack_int4(q.data).to(torch.int8)
            grid = (self.groups, self.out_features, self.in_features // q.group_size)
            self.codes = codes.contiguous().view(self.groups, self.out_features, self.in_features)
            self.scales = q.scales.float().contiguous().view(grid)
            self.offsets = None if q.offsets is None else q.offsets.float().contiguous().view(grid)
            self.weight = None  # the float copy is not kept
            return
        w = tensor.dequantize() if isinstance(tensor, GGMLTensor) else tensor
        assert self.weight is not None  # float until blocks are loaded
        self.weight.copy_(w.to(self.weight.dtype))

    def dequantized(self) -> torch.Tensor:
        """The maps as float (G, N, K)."""
        if self.weight is not None:
            return self.weight.view(self.groups, self.out_features, self.in_features)
        assert self.codes is not None and self.scales is not None  # loaded as blocks
        w = self.codes.float().view(*self.scales.shape, -1) * self.scales[..., None]
        if self.offsets is not None:
            w = w + self.offsets[..., None]
        return w.view(self.groups, self.out_features, self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (T, G, in) -> (T, G, out)."""
        if self.codes is not None and x.shape[0] <= KERNEL_ROWS and x.dtype == torch.float32 and x.device.type == "cpu":
            return torch.ops.tokenloom_grouped.grouped_matvec(x.contiguous(), self.codes, self.scales, self.offsets)
        w = self.dequantized().to(x.dtype)
        return torch.bmm(x.transpose(0, 1), w.transpose(1, 2)).transpose(0, 1)

    def extra_repr(self) -> str:
        kind = "float" if self.weight is not None else "int8 codes"
        return f"groups={self.groups}, in_features={self.in_features}, out_features={self.out_features}, {kind}"
