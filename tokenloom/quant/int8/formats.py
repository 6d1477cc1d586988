"""Quantized weight formats: int8 and int4 in blocks of 32 along the input dimension.

A ``QuantizedTensor`` is a (N, K) weight matrix stored as

- int8: ``data`` int8 (N, K); ``w = data * scales[n, k // group]`` (symmetric);
  ``group == K`` is one scale per output channel.
- int4: ``data`` uint8 (N, K/2), two values per byte; ``w = q * scales + offsets``
  with q in 0..15 per group (asymmetric: ``offsets`` is the value of code 0, i.e.
  ``-zero_point * scale``). Within each block of 32 values byte j holds value j in
  its low nibble and value j+16 in its high nibble: GGUF's Q4_0/Q4_1 layout, so
  those blocks load without conversion.

Scales and offsets are float16 values held in float32 (``quantize`` rounds them to the
float16 grid, as GGUF stores them), so the panel layout (panels.py) keeps them in half
the bytes without changing a weight.

Rows are independent (groups never cross a row), so row slices and row
permutations of a QuantizedTensor are exact. Everything here is plain torch,
the reference the CPU kernels are tested against.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import torch

BLOCK = 32
INT4_GROUP_SIZES = (32, 64, 128)


@dataclass
class QuantizedTensor:
    bits: int  # 8 or 4
    data: torch.Tensor  # int8 (N, K) or uint8 (N, K/2)
    scales: torch.Tensor  # float32 (N, K / group); float16 in the panel layout
    offsets: torch.Tensor | None  # like scales for int4, None for int8
    group_size: int

    @property
    def shape(self) -> tuple[int, int]:
        return self.data.shape[0], self.scales.shape[1] * self.group_size

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.data, self.scales, self.offsets) if t is not None)

    def rows(self, index: torch.Tensor | slice) -> QuantizedTensor:
        """The rows `index` (a slice or a 1-D index tensor) as a QuantizedTensor."""
        pick = (lambda t: t[index]) if isinstance(index, slice) else (lambda t: t.index_select(0, index))
        return QuantizedTensor(
            self.bits,
            pick(self.data),
            pick(self.scales),
            None if self.offsets is None else pick(self.offsets),
            self.group_size,
        )

    def dequantize(self) -> torch.Tensor:
        """float32 (N, K)."""
        n, k = self.shape
        q = self.data.float() if self.bits == 8 else unpack_int4(self.data).float()
        w = q.view(n, k // self.group_size, self.group_size) * self.scales[..., None]
        if self.offsets is not None:
            w = w + self.offsets[..., None]
        return w.view(n, k)

    def to(self, device: torch.device | str) -> QuantizedTensor:
        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device)

        return QuantizedTensor(
            self.bits, self.data.to(device), self.scales.to(device), move(self.offsets), self.group_size
        )


def cat_rows(parts: list[QuantizedTensor]) -> QuantizedTensor:
    """Row-concatenate tensors of one format (same bits and group size)."""
    first = parts[0]
    if any((p.bits, p.group_size, p.shape[1]) != (first.bits, first.group_size, first.shape[1]) for p in parts):
        raise ValueError("cannot concatenate quantized tensors of different formats")
    offsets = None if first.offsets is None else torch.cat(cast("list[torch.Tensor]", [p.offsets for p in parts]))
    return QuantizedTensor(
        first.bits, torch.cat([p.data for p in parts]), torch.cat([p.scales for p in parts]), offsets, first.group_size
    )


def quantize_int8(w: torch.Tensor, group_size: int | None = None) -> QuantizedTensor:
    """Symmetric int8, one scale per row (default) or per `group_size` columns: q in -127..127."""
    n, k = w.shape
    group = k if group_size is None else group_size
    _check_group(k, group)
    g = w.float().reshape(n, k // group, group)
    scales = to_half_grid(g.abs().amax(-1) / 127.0)  # (N, groups)
    inv = torch.where(scales > 0, 1.0 / scales, torch.zeros_like(scales))
    q = torch.round(g * inv[..., None]).clamp_(-127, 127).to(torch.int8)
    return QuantizedTensor(8, q.reshape(n, k).contiguous(), scales.contiguous(), None, group)


def quantize_int4(w: torch.Tensor, group_size: int = 32) -> QuantizedTensor:
    """Asymmetric int4 per group: scale = (max - min) / 15, offset = min, q in 0..15."""
    n, k = w.shape
    _check_group(k, group_size)
    g = w.float().reshape(n, k // group_size, group_size)
    lo, hi = g.amin(-1), g.amax(-1)  # (N, groups)
    scales, lo = to_half_grid((hi - lo) / 15.0), to_half_grid(lo)
    inv = torch.where(scales > 0, 1.0 / scales, torch.zeros_like(scales))
    q = torch.round((g - lo[..., None]) * inv[..., None]).clamp_(0, 15).to(torch.uint8)
    return QuantizedTensor(4, pack_int4(q.reshape(n, k)), scales.contiguous(), lo.contiguous(), group_size)


def to_half_grid(x: torch.Tensor) -> torch.Tensor:
    """float32 x rounded to the nearest float16 value, where float16 holds it (|x| < 65504)."""
    return torch.where(x.abs() < 65504, x.half().float(), x)


def on_half_grid(x: torch.Tensor) -> bool:
    """Every value of x is a float16 value (float16 holds x without change)."""
    return bool(torch.equal(x.half().float(), x))


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """uint8 (N, K) values 0..15 -> (N, K/2): per block of 32, byte j = q[j] | q[j+16] << 4."""
    n, k = q.shape
    blocks = q.view(n, k // BLOCK, 2, BLOCK // 2)
    return (blocks[:, :, 0] | (blocks[:, :, 1] << 4)).reshape(n, k // 2).contiguous()


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of pack_int4: (N, K/2) -> uint8 (N, K)."""
    n, half = packed.shape
    blocks = packed.view(n, half // (BLOCK // 2), BLOCK // 2)
    return torch.stack([blocks & 0x0F, blocks >> 4], dim=2).reshape(n, half * 2)


def quantize(w: torch.Tensor, bits: int, group_size: int | None) -> QuantizedTensor:
    """Quantize a float (N, K) weight to `bits` (8: per-channel unless a group is given; 4: group-wise)."""
    if bits == 8:
        return quantize_int8(w, group_size)
    if bits == 4:
        return quantize_int4(w, group_size or 32)
    raise ValueError(f"bits must be 8 or 4, got {bits}")


def _check_group(k: int, group: int) -> None:
    if group % BLOCK or k % group:
        raise ValueError(f"group size {group} must be a multiple of {BLOCK} that divides in_features {k}")
