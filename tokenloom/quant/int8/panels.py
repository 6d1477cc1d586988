"""The 16-column panel layout of int8/int4 weights, for the panel kernels (AVX-512 VNNI and AVX2).

The row layout (formats.py) keeps each output row's blocks together; a kernel then reduces
one row at a time. The panel layout interleaves 16 output rows so that one 512-bit
``dpbusd`` multiplies 16 columns by 4 activations at once (``csrc/quant_cpu.cpp``; AVX2 takes
each panel as two halves of 8 columns):

- int4: ``data`` (P, K/32, 4, 64) uint8, P = N/16: in panel p, block b, chunk c, bytes
  4n..4n+3 belong to output row 16p+n and byte i holds codes k = 32b+8c+i (low nibble)
  and k+4 (high nibble).
- int8: ``data`` (P, K/32, 8, 64) uint8: byte i of row 16p+n in chunk c is the code of
  k = 32b+4c+i plus 128 (dpbusd multiplies unsigned by signed bytes; the kernel subtracts
  128 x the activations' code sum).
- ``scales`` / ``offsets``: (P, groups, 16) float16, the 16 rows of a panel side by side
  (an int4 block of 32 weights reads 20 bytes instead of 24).

The same codes as the row layout, re-ordered, and the same scales in float16: only tensors
whose scales are float16 values (what ``quantize`` and GGUF give) take the layout, so
``to_panels`` and ``from_panels`` are exact inverses (tested), plain torch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import torch

from tokenloom.memory import huge_pages
from tokenloom.quant.int8.formats import BLOCK, QuantizedTensor, on_half_grid, pack_int4, unpack_int4

PANEL = 16


def fits(t: QuantizedTensor) -> bool:
    """The panel kernels take this tensor: whole panels of 16 output rows, float16 scales, and
    int8 codes in -127..127, as ``quantize`` and llama.cpp's Q8_0 give them (the AVX2 kernel
    multiplies a code by an activation's sign, which -128 does not survive)."""
    return (
        t.shape[0] % PANEL == 0
        and all(on_half_grid(x) for x in (t.scales, t.offsets) if x is not None)
        and (t.bits == 4 or not bool((t.data == -128).any()))
    )


def _codes(t: QuantizedTensor) -> torch.Tensor:
    """(N, K) codes: int4 as 0..15 (uint8), int8 as -127..127 (int8)."""
    return unpack_int4(t.data) if t.bits == 4 else t.data


def _side_by_side(x: torch.Tensor) -> torch.Tensor:
    """(N, G) per-row float32 values -> (P, G, 16) float16."""
    n, g = x.shape
    return x.view(n // PANEL, PANEL, g).transpose(1, 2).to(torch.float16).contiguous()


def _row_by_row(x: torch.Tensor) -> torch.Tensor:
    """(P, G, 16) float16 -> (N, G) float32."""
    p, g, _ = x.shape
    return x.transpose(1, 2).reshape(p * PANEL, g).float().contiguous()


def to_panels(t: QuantizedTensor) -> QuantizedTensor:
    """Row layout -> panel layout (same format, shapes as in the module docstring)."""
    if not fits(t):
        raise ValueError(
            f"the panel layout needs a multiple of {PANEL} output rows and float16 scales, got {t.shape[0]} rows"
        )
    return cast(QuantizedTensor, from_row_chunks(t.rows, t.shape[0]))  # fits(t): so does each chunk


def empty(bits: int, n: int, k: int, group_size: int) -> QuantizedTensor:
    """Uninitialized panel-layout buffers for an (n, k) weight (n a multiple of 16), from the
    load's huge-page arena where there is one (memory/huge_pages.py)."""
    p, groups = n // PANEL, k // group_size
    data = huge_pages.empty((p, k // BLOCK, 4 if bits == 4 else 8, 64), torch.uint8)
    scales = huge_pages.empty((p, groups, PANEL), torch.float16)
    offsets = huge_pages.empty((p, groups, PANEL), torch.float16) if bits == 4 else None
    return QuantizedTensor(bits, data, scales, offsets, group_size)


def panel_rows(t: QuantizedTensor, rows: slice) -> QuantizedTensor:
    """Rows `rows` (whole panels: start and stop multiples of 16) of a panel-layout tensor, a view."""
    panels = slice(rows.start // PANEL, rows.stop // PANEL)
    offsets = None if t.offsets is None else t.offsets[panels]
    return QuantizedTensor(t.bits, t.data[panels], t.scales[panels], offsets, t.group_size)


def from_row_chunks(read: Callable[[slice], QuantizedTensor], n: int) -> QuantizedTensor | None:
    """The panel layout of an `n`-row weight whose rows `read(rows)` gives in the row layout, re-laid
    a chunk of rows at a time: temporaries stay small for a vocabulary head, and a source in another
    layout (GGUF blocks) is never converted whole beside the panels. None where a chunk does not
    fit the panel layout (`fits`)."""
    whole: list[Any] | None = None  # the panel buffers (None for absent offsets)
    chunk: QuantizedTensor | None = None
    for start in range(0, n, _CHUNK_ROWS):
        rows = slice(start, min(n, start + _CHUNK_ROWS))
        chunk = read(rows)
        if not fits(chunk):
            return None
        parts = (
            _panel_bytes(chunk),
            _side_by_side(chunk.scales),
            None if chunk.offsets is None else _side_by_side(chunk.offsets),
        )
        if whole is None:  # (P, ...) buffers shaped as the first chunk's panels
            whole = [None if part is None else part.new_empty((n // PANEL, *part.shape[1:])) for part in parts]
        for buffer, part in zip(whole, parts):
            if buffer is not None:
                buffer[start // PANEL : rows.stop // PANEL] = part
    assert whole is not None and chunk is not None  # n > 0 rows: one chunk at least
    return QuantizedTensor(chunk.bits, whole[0], whole[1], whole[2], chunk.group_size)


_CHUNK_ROWS = 4096


def _panel_bytes(t: QuantizedTensor) -> torch.Tensor:
    """The (N/16, K/32, chunks, 64) panel bytes of a row-layout tensor."""
    n, k = t.shape
    p, nb = n // PANEL, k // BLOCK
    if t.bits == 4:
        c = _codes(t).view(p, PANEL, nb, 4, 2, 4)  # [p, n, b, c, half, i]
        return (c[..., 0, :] | (c[..., 1, :] << 4)).permute(0, 2, 3, 1, 4).reshape(p, nb, 4, 64)
    c = (_codes(t).to(torch.int16) + 128).to(torch.uint8).view(p, PANEL, nb, 8, 4)  # [p, n, b, c, i]
    return c.permute(0, 2, 3, 1, 4).reshape(p, nb, 8, 64)


def _row_bytes(b: torch.Tensor, bits: int) -> torch.Tensor:
    """(L, K/32, chunks, 4) panel bytes of L output rows -> their (L, K) row-layout data."""
    n, nb = b.shape[:2]
    if bits == 4:  # [n, b, c, i]; k = 32b + 8c + 4 half + i
        return pack_int4(torch.stack([b & 0x0F, b >> 4], dim=3).reshape(n, nb * BLOCK))
    return (b.reshape(n, nb * BLOCK).to(torch.int16) - 128).to(torch.int8)


def from_panels(t: QuantizedTensor) -> QuantizedTensor:
    """Panel layout -> row layout: the exact inverse of ``to_panels``."""
    p, nb, chunks = t.data.shape[:3]
    b = t.data.view(p, nb, chunks, PANEL, 4).permute(0, 3, 1, 2, 4).reshape(p * PANEL, nb, chunks, 4)
    offsets = None if t.offsets is None else _row_by_row(t.offsets)
    return QuantizedTensor(t.bits, _row_bytes(b, t.bits).contiguous(), _row_by_row(t.scales), offsets, t.group_size)


def rows(t: QuantizedTensor, index: torch.Tensor) -> QuantizedTensor:
    """Rows `index` (1-D) of a panel-layout tensor, in the row layout (an embedding lookup).

    Reads only the picked rows' bytes (4 per chunk), not their whole panels.
    """
    p, nb, chunks = t.data.shape[:3]
    panel, lane = index // PANEL, index % PANEL
    b = t.data.view(p, nb, chunks, PANEL, 4)[panel, :, :, lane]  # (L, nb, chunks, 4)
    offsets = None if t.offsets is None else t.offsets[panel, :, lane].float()
    return QuantizedTensor(
        t.bits, _row_bytes(b, t.bits).contiguous(), t.scales[panel, :, lane].float(), offsets, t.group_size
    )
