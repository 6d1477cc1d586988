"""GGUF Q5_0, Q5_1, Q4_K, Q5_K, Q6_K and MXFP4 blocks re-laid in 16-row panels (AVX-512 VNNI and AVX2 kernels).

The same values as the file's blocks, in the layout ``csrc/ggml_cpu.cpp``'s panel kernel
reads 16 output rows at a time from (see the comment there): low nibbles of the codes
(``lo``), their bits 4 and 5 in bit planes (``hi``), and per-row scales (and offsets) side by
side. K-quants keep their two levels of scales: the integer sub-scales (and sub-mins) of each
block, and per super-block of 256 values the float ``d`` (and ``-dmin``), multiplied in the
kernel (exact in float32: a float16 times an integer of at most 8 bits). MXFP4 keeps its 4-bit
indices into its value table (``MXFP4_CODES``, the kernel's table) and its e8m0 scale bytes. Bytes
per 32 weights against the file: Q5_0 22 (22), Q5_1 24 (24), Q4_K 19 (18), Q5_K 23 (22), Q6_K 26.5
(26.25), MXFP4 17 (17).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from tokenloom.memory import huge_pages
from tokenloom.quant.gguf.tensor import KERNEL_TYPES, GGMLTensor, ops

PANEL = 16
Q5_0, Q5_1, Q4_K, Q5_K, Q6_K, MXFP4 = 6, 7, 12, 13, 14, 39
# type -> (high bit planes, zero point, per-16 scales, offsets, scale dtype: K-quants' integer
# sub-scales, MXFP4's e8m0 bytes)
LAYOUTS = {
    Q5_0: (1, 16, False, False, torch.float16),
    Q5_1: (1, 0, False, True, torch.float16),
    Q4_K: (0, 0, False, True, torch.uint8),
    Q5_K: (1, 0, False, True, torch.uint8),
    Q6_K: (2, 32, True, False, torch.int8),
    MXFP4: (0, 12, False, False, torch.uint8),
}
# MXFP4's doubled e2m1 values plus its zero point 12, by 4-bit index (csrc/ggml_cpu.cpp's kMXFP4U);
# a weight is (code - 12) * 2^(e - 128)
MXFP4_CODES = torch.tensor([12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0], dtype=torch.int32)
K_QUANTS = (Q4_K, Q5_K, Q6_K)
_CHUNK_ROWS = 256


@dataclass
class GGUFPanels:
    kind: int
    lo: torch.Tensor  # (P, K/32, 4, 64) uint8
    hi: torch.Tensor | None  # (P, K/32, planes, 64) uint8
    scale: torch.Tensor  # (P, K/32, 16) or (P, K/32, 2, 16)
    offset: torch.Tensor | None  # like scale
    in_features: int
    dsup: torch.Tensor | None = None  # K-quants: (P, K/256, 16) float32 super-block scales d
    msup: torch.Tensor | None = None  # Q4_K, Q5_K: (P, K/256, 16) float32 super-block mins -dmin

    @property
    def shape(self) -> tuple[int, int]:
        return self.lo.shape[0] * PANEL, self.in_features

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    @property
    def type_name(self) -> str:
        return KERNEL_TYPES[self.kind][0]

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.lo, self.hi, self.scale, self.offset, self.dsup, self.msup) if t is not None]

    def matmul_into(self, out: torch.Tensor, col0: int, xq: torch.Tensor) -> None:
        ops().panel_matmul_into(
            out, col0, xq, self.in_features, self.kind, self.lo, self.hi, self.scale, self.offset, self.dsup, self.msup
        )

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None, silu_mul: bool = False) -> torch.Tensor:
        """x (M, K) float32 contiguous -> x @ w.T + bias (M, N) in one call, or with `silu_mul`
        silu(gate) * up (M, N/2) for a gate_up weight (gate rows first)."""
        return ops().panel_linear(
            x, self.kind, self.lo, self.hi, self.scale, self.offset, self.dsup, self.msup, bias, silu_mul
        )

    def followed_by(self, other: GGUFPanels) -> GGUFPanels | None:
        """These rows then `other`'s as one tensor (one kernel call for both; from the load's
        huge-page arena, ``huge_pages.cat``), or None where the two differ in type or width. Rows
        are independent, so each output is unchanged."""
        if other.kind != self.kind or other.in_features != self.in_features:
            return None

        def cat(a: torch.Tensor | None, b: torch.Tensor | None) -> torch.Tensor | None:
            if a is None:
                return None
            assert b is not None  # the same kind: the same tensors
            return huge_pages.cat(a, b)

        return GGUFPanels(
            self.kind,
            cat(self.lo, other.lo),  # type: ignore[arg-type]
            cat(self.hi, other.hi),
            cat(self.scale, other.scale),  # type: ignore[arg-type]
            cat(self.offset, other.offset),
            self.in_features,
            cat(self.dsup, other.dsup),
            cat(self.msup, other.msup),
        )

    def rows(self, index: torch.Tensor) -> torch.Tensor:
        """float32 (len(index), K): rows `index` dequantized (an embedding lookup)."""
        planes, zero, per16, _, _ = LAYOUTS[self.kind]
        p, nb = self.lo.shape[:2]
        panel, lane = index // PANEL, index % PANEL
        lo = self.lo.view(p, nb, 4, PANEL, 4)[panel, :, :, lane]  # (L, nb, c, i)
        codes = torch.stack([lo & 0x0F, lo >> 4], dim=3).int()  # (L, nb, c, h, i)
        shifts = torch.arange(8, dtype=torch.int32).view(4, 2, 1)  # bit 2c + h
        for j in range(planes):
            assert self.hi is not None  # a layout with bit planes has them
            hi = self.hi.view(p, nb, planes, PANEL, 4)[panel, :, j, lane].int()  # (L, nb, i)
            codes |= ((hi[:, :, None, None, :] >> shifts) & 1) << (4 + j)
        if self.kind == MXFP4:
            codes = MXFP4_CODES[codes]
        w = codes.reshape(len(index), nb, 32).float() - zero
        scale = (self.scale[panel, :, :, lane] if per16 else self.scale[panel, :, lane]).float()  # (L, nb[, 2])
        if self.kind == MXFP4:  # e8m0: 2^(e - 128) for the doubled values
            scale = torch.exp2(scale - 128)
        offset = None if self.offset is None else self.offset[panel, :, lane].float()
        if self.dsup is not None:  # K-quants: times d (and -dmin)
            d = self.dsup[panel, :, lane].repeat_interleave(8, dim=1)  # (L, nb)
            scale = scale * (d[..., None] if per16 else d)
            if offset is not None:
                assert self.msup is not None  # a K-quant with offsets has their super-block mins
                offset = offset * self.msup[panel, :, lane].repeat_interleave(8, dim=1)
        w = w * (scale.repeat_interleave(16, dim=-1) if per16 else scale[..., None])
        if offset is not None:
            w = w + offset[..., None]
        return w.reshape(len(index), self.in_features)


def available() -> bool:
    """A build with the panel kernel (AVX-512 VNNI, or AVX2) runs here."""
    kernels = ops()
    return kernels is not None and hasattr(kernels, "panel_matmul_into")


def fits(t: GGMLTensor) -> bool:
    return t.kind in LAYOUTS and t.shape[0] % PANEL == 0 and available()


def to_panels(t: GGMLTensor, in_cpp: bool = True) -> GGUFPanels:
    """Re-lay `t` (a type in LAYOUTS, rows a multiple of 16): in one C++ pass where the GGUF
    kernels are built and `in_cpp`, else in numpy a chunk of rows at a time. The same bits.
    Buffers come from ``huge_pages.empty`` (the load's arena, if any)."""
    planes, _, per16, offs, dtype = LAYOUTS[t.kind]
    n, k = t.shape
    p, nb = n // PANEL, k // 32
    lo = huge_pages.empty((p, nb, 4, 64), torch.uint8)
    hi = huge_pages.empty((p, nb, planes, 64), torch.uint8) if planes else None
    scale = huge_pages.empty((p, nb, 2, PANEL) if per16 else (p, nb, PANEL), dtype)
    offset = huge_pages.empty(tuple(scale.shape), dtype) if offs else None
    dsup = huge_pages.empty((p, nb // 8, PANEL), torch.float32) if t.kind in K_QUANTS else None
    msup = huge_pages.empty((p, nb // 8, PANEL), torch.float32) if dsup is not None and offs else None
    panels = GGUFPanels(t.kind, lo, hi, scale, offset, k, dsup, msup)
    kernels = ops()
    if in_cpp and kernels is not None and hasattr(kernels, "relay_panels"):  # csrc/panel_relay.h
        kernels.relay_panels(t.data, t.kind, k, lo, hi, scale, offset, dsup, msup)
    else:
        for start in range(0, n, _CHUNK_ROWS):
            _relay_rows_in_numpy(t, start, min(n, start + _CHUNK_ROWS), panels)
    return panels


def _relay_rows_in_numpy(t: GGMLTensor, start: int, stop: int, out: GGUFPanels) -> None:
    """Rows start..stop of `t` (multiples of 16) into their panels of `out`."""
    planes, _, per16, _, dtype = LAYOUTS[t.kind]
    codes, s, o = decode(t.kind, t.data[start:stop].numpy(), t.shape[1])
    sl = slice(start // PANEL, stop // PANEL)
    out.lo[sl], hi_part = _pack_codes(codes, planes)
    if out.hi is not None:
        assert hi_part is not None  # planes > 0
        out.hi[sl] = hi_part
    out.scale[sl], sup = _sides(s, per16, dtype)
    if out.dsup is not None:
        assert sup is not None  # a K-quant's scales come with their super-block factors
        out.dsup[sl] = sup
    if out.offset is not None:
        out.offset[sl], sup = _sides(o, per16, dtype)
        if out.msup is not None:
            assert sup is not None  # likewise its offsets
            out.msup[sl] = sup


def _pack_codes(codes: np.ndarray, planes: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(N, K) uint8 codes -> lo (P, nb, 4, 64) and hi (P, nb, planes, 64) as the kernel reads them.
    All in uint8: a chunk's temporaries are a few times its codes, not int32/int64 copies of them."""
    n, k = codes.shape
    c = codes.reshape(n // PANEL, PANEL, k // 32, 4, 2, 4)  # [p, n, b, c, h, i]
    packed = (c[..., 0, :] & 0x0F) | ((c[..., 1, :] & 0x0F) << 4)  # [p, n, b, c, i]
    lo = torch.from_numpy(np.ascontiguousarray(packed.transpose(0, 2, 3, 1, 4)).reshape(n // PANEL, k // 32, 4, 64))
    if not planes:
        return lo, None
    hi = np.empty((n // PANEL, k // 32, planes, PANEL, 4), dtype=np.uint8)  # [p, b, j, n, i]
    for j in range(planes):
        bits = ((c >> (4 + j)) & 1).transpose(0, 2, 1, 5, 3, 4)  # [p, b, n, i, c, h]: bit 2c + h
        hi[:, :, j] = np.packbits(bits.reshape(*bits.shape[:4], 8), axis=-1, bitorder="little")[..., 0]
    return lo, torch.from_numpy(hi.reshape(n // PANEL, k // 32, planes, 64))


def _sides(values, per16: bool, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
    """decode's scales (or offsets) side by side: (P, nb, 16) or (P, nb, 2, 16) in `dtype`, and
    for a K-quant's (sub, super) pair its super-block factors (P, nb/8, 16) float32."""
    sub, sup = values if isinstance(values, tuple) else (values, None)
    return (
        _side_by_side(torch.from_numpy(sub), per16).to(dtype),
        None if sup is None else _side_by_side(torch.from_numpy(sup), False),
    )


def _side_by_side(x: torch.Tensor, per16: bool) -> torch.Tensor:
    """(N, nb) or (N, nb, 2) per-row values -> (P, nb, 16) or (P, nb, 2, 16)."""
    n = x.shape[0]
    x = x.view(n // PANEL, PANEL, *x.shape[1:])
    return (x.permute(0, 2, 3, 1) if per16 else x.permute(0, 2, 1)).contiguous()


def half_field(blocks: np.ndarray, at: int) -> np.ndarray:
    """(..., bytes) blocks -> their float16 field at byte `at`, as float32 (...)."""
    return np.ascontiguousarray(blocks[..., at : at + 2]).view(np.float16)[..., 0].astype(np.float32)


def nibbles(blocks: np.ndarray) -> np.ndarray:
    """The last 16 bytes of each 32-value block (..., bytes), unpacked to (..., 32) values 0..15 in
    order (byte j: value j in its low nibble, j + 16 in its high one)."""
    packed = blocks[..., -16:]
    return np.concatenate([packed & 0x0F, packed >> 4], axis=-1)


def _k4_scales(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(rows, nsb, 12) packed Q4_K/Q5_K scales -> 6-bit scales and mins, (rows, nsb, 8) uint8 each."""
    d, m, md = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = np.concatenate([d & 63, (md & 0x0F) | ((d >> 6) << 4)], axis=-1)
    mn = np.concatenate([m & 63, (md >> 4) | ((m >> 6) << 4)], axis=-1)
    return sc, mn


def decode(kind: int, raw: np.ndarray, k: int) -> tuple[np.ndarray, object, object]:
    """Raw rows -> unsigned codes (rows, K) uint8, scales, offsets (or None). Q5_0/Q5_1: float32
    (rows, K/32). K-quants: (sub, super) pairs, integer sub-scales per block (rows, K/32) uint8, or
    (rows, K/32, 2) int8 for Q6_K's per-16 ones, and float32 (rows, K/256) super-block d (-dmin
    for the offsets' pair); a weight's scale is their product."""
    rows = raw.shape[0]
    if kind == MXFP4:  # indices into its table (the kernel's business) and the e8m0 scale bytes
        blocks = raw.reshape(rows, k // 32, 17)
        return nibbles(blocks).reshape(rows, k), np.ascontiguousarray(blocks[..., 0]), None
    if kind in (Q5_0, Q5_1):
        blocks = raw.reshape(rows, k // 32, -1)
        qh = np.ascontiguousarray(blocks[:, :, -20:-16]).view(np.uint32)  # (rows, nb, 1)
        high: np.ndarray = (((qh >> np.arange(32, dtype=np.uint32)) & 1) << 4).astype(np.uint8)
        codes: np.ndarray = nibbles(blocks) | high
        offsets = half_field(blocks, 2) if kind == Q5_1 else None
        return codes.reshape(rows, k), half_field(blocks, 0), offsets
    blocks = raw.reshape(rows, k // 256, -1)  # (rows, nsb, bytes)
    if kind in (Q4_K, Q5_K):
        d, dmin = half_field(blocks, 0), half_field(blocks, 2)  # (rows, nsb)
        sc, mn = _k4_scales(blocks[..., 4:16])
        qs = blocks[..., -128:].reshape(rows, -1, 4, 32)  # (rows, nsb, pair, l)
        codes = np.stack([qs & 0x0F, qs >> 4], axis=3)  # (rows, nsb, pair, half, l)
        if kind == Q5_K:
            qh = blocks[..., 16:48]  # (rows, nsb, l)
            bits = (qh[:, :, None, :] >> np.arange(8, dtype=np.uint8)[:, None]) & 1  # (rows, nsb, s, l)
            codes = codes | (bits.reshape(rows, -1, 4, 2, 32) << 4)
        return codes.reshape(rows, k), (sc.reshape(rows, -1), d), (mn.reshape(rows, -1), -dmin)
    if kind == Q6_K:
        ql = blocks[..., 0:128].reshape(rows, -1, 2, 2, 32)  # (rows, nsb, n, j&1, l)
        low = np.stack([ql & 0x0F, ql >> 4], axis=3)  # (rows, nsb, n, j>>1, j&1, l)
        qh = blocks[..., 128:192].reshape(rows, -1, 2, 1, 32)  # (rows, nsb, n, 1, l)
        high = (qh >> (2 * np.arange(4, dtype=np.uint8))[:, None]) & 3  # (rows, nsb, n, j, l)
        codes = low.reshape(rows, -1, 2, 4, 32) | (high << 4)
        sc = np.ascontiguousarray(blocks[..., 192:208]).view(np.int8)  # (rows, nsb, 16)
        return codes.reshape(rows, k), (sc.reshape(rows, -1, 2), half_field(blocks, 208)), None
    raise ValueError(f"GGML type {kind} has no panel layout")
