"""GGUF weight blocks kept exactly as the file stores them, and the kernels that run them.

A ``GGMLTensor`` is an (N, K) weight whose rows are the file's own blocks (bytes as in
llama.cpp's ggml-common.h): Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K,
IQ4_NL, IQ4_XS, MXFP4. ``csrc/ggml_cpu.cpp`` multiplies activations by them (AVX2, or AVX-512
VNNI where the CPU has it) and dequantizes rows; without the kernels, the ``gguf``
package's own dequantization does the same work in numpy (correct, slow).

Where the panel kernels run (AVX-512 VNNI, or AVX2: every x86 CPU tokenloom's kernels build
for) the common types load re-laid in 16-row panels, values unchanged:
Q8_0, Q4_0, Q4_1, IQ4_NL as tokenloom's int8/int4 formats (``quant/gguf/blocks.py``),
Q5_0, Q5_1, Q4_K, Q5_K, Q6_K in ``quant/gguf/panels.py``; the rest stay GGMLTensors.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from tokenloom.kernels import native

_SOURCE = Path(__file__).parent / "csrc" / "ggml_cpu.cpp"
_BUILDS = (("avx512vnni", "tokenloom_ggml_vnni"), ("avx2", "tokenloom_ggml"))

# GGML type id -> (name, values per block, bytes per block), for the types the kernels run.
KERNEL_TYPES = {
    2: ("Q4_0", 32, 18),
    3: ("Q4_1", 32, 20),
    6: ("Q5_0", 32, 22),
    7: ("Q5_1", 32, 24),
    8: ("Q8_0", 32, 34),
    10: ("Q2_K", 256, 84),
    11: ("Q3_K", 256, 110),
    12: ("Q4_K", 256, 144),
    13: ("Q5_K", 256, 176),
    14: ("Q6_K", 256, 210),
    20: ("IQ4_NL", 32, 18),
    23: ("IQ4_XS", 256, 136),
    39: ("MXFP4", 32, 17),
}


def ops():
    """The GGML kernels' torch.ops namespace (fastest build for this CPU), or None."""
    return native.fastest(_SOURCE, "GGUF block kernels", _BUILDS)


def type_name(kind: int) -> str:
    from gguf import GGMLQuantizationType

    try:
        return GGMLQuantizationType(kind).name
    except ValueError:
        return f"type {kind}"


@dataclass
class GGMLTensor:
    """An (N, K) matrix of GGUF blocks: ``data`` uint8 (N, K / values_per_block * bytes_per_block).

    ``read_rows``, where ``data`` views a file map, reads rows by index from the file instead
    (``rows(index)``): an embedding looked up a few rows at a time then maps none of the file's
    pages (the kernel maps 64 KiB around each row it faults in, and the resident size, its peak
    included, would count every token's neighbourhood)."""

    kind: int
    data: torch.Tensor
    in_features: int
    read_rows: Callable[[torch.Tensor], torch.Tensor] | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.kind not in KERNEL_TYPES:
            raise ValueError(f"GGML type {type_name(self.kind)} has no kernel")
        _, values, nbytes = KERNEL_TYPES[self.kind]
        if self.in_features % values or self.data.shape[1] != self.in_features // values * nbytes:
            raise ValueError(
                f"{self.type_name} rows of {self.data.shape[1]} bytes do not hold {self.in_features} values"
            )

    @property
    def type_name(self) -> str:
        return KERNEL_TYPES[self.kind][0]

    @property
    def shape(self) -> tuple[int, int]:
        return self.data.shape[0], self.in_features

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    def tensors(self) -> list[torch.Tensor]:
        return [self.data]

    def matmul_into(self, out: torch.Tensor, col0: int, xq: torch.Tensor) -> None:
        """out[:, col0 : col0 + N] = x @ self.T for xq = ops().quantize_activations(x)."""
        ops().matmul_into(out, col0, xq, self.in_features, self.data, self.kind)

    def rows(self, index: torch.Tensor | slice) -> GGMLTensor:
        """Rows `index` (a slice or a 1-D index tensor); rows are independent blocks."""
        if isinstance(index, slice):
            data = self.data[index]
        else:
            data = self.read_rows(index) if self.read_rows is not None else self.data.index_select(0, index)
        return GGMLTensor(self.kind, data, self.in_features)

    def columns(self, start: int, count: int) -> GGMLTensor:
        """Input columns [start, start + count) of every row: whole blocks only (ValueError else)."""
        _, values, nbytes = KERNEL_TYPES[self.kind]
        if start % values or count % values:
            raise ValueError(
                f"{self.type_name} blocks hold {values} values: columns {start}..{start + count} "
                "do not fall on block boundaries"
            )
        data = self.data[:, start // values * nbytes : (start + count) // values * nbytes]
        return GGMLTensor(self.kind, data, count)

    def padded_rows(self, rows: int) -> GGMLTensor:
        """The matrix with zero rows appended up to `rows` (all-zero blocks hold zeros: a zero scale)."""
        pad = self.data.new_zeros(rows - self.data.shape[0], self.data.shape[1])
        return GGMLTensor(self.kind, torch.cat([self.data, pad]), self.in_features)

    def dequantize(self) -> torch.Tensor:
        """float32 (N, K), exactly the values llama.cpp reads."""
        kernels = ops()
        if kernels is not None and self.data.device.type == "cpu":
            return kernels.dequantize(self.data.contiguous(), self.kind, self.in_features)
        from gguf import GGMLQuantizationType, quants

        array = quants.dequantize(self.data.cpu().numpy(), GGMLQuantizationType(self.kind))
        return torch.from_numpy(np.ascontiguousarray(array, dtype=np.float32)).view(self.shape).to(self.data.device)
