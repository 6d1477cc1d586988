"""GGUF block types that are tokenloom int8/int4 formats as they stand: exact conversions.

Each of these has one float16 scale (and for int4 an offset) per 32 values, which is the
row layout of ``formats.py`` (so also the AVX-512 panel layout) with no value changed:

- Q8_0  (34 B: fp16 d, 32 x int8 q):          int8-g32, codes q, scale d
- Q5_0  (22 B: fp16 d, u32 qh, 16 B nibbles):  int8-g32, codes q - 16 (5-bit q), scale d
- IQ4_NL (18 B: fp16 d, 16 B nibbles):         int8-g32, codes kvalues[nibble], scale d
- Q4_0  (18 B: fp16 d, 16 B nibbles):          int4-g32, codes q, scale d, offset -8 d
- Q4_1  (20 B: fp16 d, fp16 m, 16 B nibbles):  int4-g32, codes q, scale d, offset m

Nibble byte j of a block holds value j (low) and j + 16 (high), as in ``formats.pack_int4``.
"""

from __future__ import annotations

import numpy as np
import torch

from tokenloom.quant.gguf import panels as gguf_panels
from tokenloom.quant.gguf.panels import half_field, nibbles
from tokenloom.quant.gguf.tensor import GGMLTensor, ops
from tokenloom.quant.int8.formats import QuantizedTensor
from tokenloom.quant.scheme import WeightFormat

Q4_0, Q4_1, Q5_0, Q8_0, IQ4_NL = 2, 3, 6, 8, 20
EXACT_FORMATS = {
    Q8_0: WeightFormat(8, 32),
    Q5_0: WeightFormat(8, 32),
    IQ4_NL: WeightFormat(8, 32),
    Q4_0: WeightFormat(4, 32),
    Q4_1: WeightFormat(4, 32),
}
_IQ4NL_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.int8)


def exact_format(kind: int) -> WeightFormat | None:
    """The tokenloom format that holds GGML type `kind` without a change of value, if any
    (Q5_0 only where its own panel kernel, which reads 22 bytes per 32 weights, not 34, does not run)."""
    if kind in gguf_panels.LAYOUTS and gguf_panels.available():
        return None
    return EXACT_FORMATS.get(kind)


def to_quantized(t: GGMLTensor) -> QuantizedTensor:
    """The QuantizedTensor with exactly `t`'s values (`t.kind` must have an ``exact_format``)."""
    if t.kind not in EXACT_FORMATS:
        raise ValueError(f"{t.type_name} is not a tokenloom format as it stands")
    rows = t.shape[0]
    raw = t.data.cpu().numpy()
    blocks = raw.reshape(rows, t.in_features // 32, -1)  # (rows, nb, bytes)
    d = torch.from_numpy(half_field(blocks, 0))
    if t.kind == Q8_0:
        codes = blocks[:, :, 2:].view(np.int8)
    elif t.kind == Q5_0:
        unsigned, _, _ = gguf_panels.decode(t.kind, raw, t.in_features)  # (rows, K) 0..31
        codes = (unsigned.astype(np.int16) - 16).astype(np.int8)
    elif t.kind == IQ4_NL:
        codes = _IQ4NL_VALUES[nibbles(blocks)]
    else:
        packed = torch.from_numpy(np.ascontiguousarray(blocks[:, :, -16:]).reshape(rows, -1))
        offsets = -8.0 * d if t.kind == Q4_0 else torch.from_numpy(half_field(blocks, 2))
        return QuantizedTensor(4, packed, d, offsets, 32)
    return QuantizedTensor(8, torch.from_numpy(np.ascontiguousarray(codes).reshape(rows, -1)), d, None, 32)


def relay_into_panels(t: GGMLTensor, panels: QuantizedTensor, panel_start: int) -> bool:
    """Write `t` (Q8_0, Q4_0 or Q4_1 rows, a multiple of 16) into the int8/int4 panel layout
    `panels` (quant/int8/panels.py) from panel `panel_start` on, in one C++ pass: the same bytes
    as ``int8.panels.to_panels(to_quantized(t))``. False where it cannot: no GGUF kernels built,
    another type, or a Q8_0 code of -128 (the panel layout has none; what was written is then
    not whole)."""
    kernels = ops()
    if kernels is None or not hasattr(kernels, "relay_exact_panels") or t.kind not in (Q8_0, Q4_0, Q4_1):
        return False
    return bool(
        kernels.relay_exact_panels(
            t.data, t.kind, t.in_features, panels.data, panels.scales, panels.offsets, panel_start
        )
    )
