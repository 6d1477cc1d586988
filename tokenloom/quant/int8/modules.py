"""Quantized drop-ins for nn.Linear and a tied nn.Embedding, and the module swap.

``QuantizedLinear`` keeps nn.Linear's forward contract, ``x (..., in) -> (..., out)``
in x's dtype, with its weight stored as a QuantizedTensor (formats.py). On an AVX2
CPU it runs the compiled kernels; anywhere else (GPU, other CPUs) it dequantizes
the weight per call and runs a float matmul: same numbers, no speed-up.
The kernel serves every batch size: against dequantize + float GEMM it wins from 1 to 128
rows (docs/BENCHMARKS.md, 'Measurements behind design choices'). Where the panel kernels run
(AVX-512 VNNI, AVX2) ``use_panels`` re-lays the weight in 16-row panels (quant/int8/panels.py)
for kernels that take 16 output columns per instruction; ``weight_q`` and saved checkpoints
keep the row layout either way.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Literal, cast

import torch
import torch.nn.functional as F
from torch import nn

from tokenloom.quant.gguf.blocks import exact_format, relay_into_panels, to_quantized
from tokenloom.quant.gguf.modules import GGMLEmbedding, GGMLLinear, float_rows
from tokenloom.quant.gguf.tensor import GGMLTensor
from tokenloom.quant.int8 import kernels, panels
from tokenloom.quant.int8.formats import BLOCK, QuantizedTensor, quantize
from tokenloom.quant.scheme import WeightFormat

log = logging.getLogger(__name__)

GGML_BLOCKS = "ggml"  # a format_of answer: keep the GGUF file's blocks (GGMLLinear / GGMLEmbedding)


class QuantizedLinear(nn.Module):
    """A Linear layer whose weight is int8 or int4 (buffers ``qweight``, ``scales``, ``offsets``)."""

    _kernel: Callable[[torch.Tensor], torch.Tensor] | Literal[False] | None
    _silu_kernel: Callable[[torch.Tensor], torch.Tensor] | Literal[False] | None

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        fmt: WeightFormat,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        if not self.supports(in_features, fmt):
            raise ValueError(
                f"{fmt.name} needs in_features divisible by the group size and by {BLOCK}, got {in_features}"
            )
        self.in_features, self.out_features, self.fmt = in_features, out_features, fmt
        self.group_size = fmt.group_size or in_features
        groups = in_features // self.group_size
        qdtype, cols = (torch.int8, in_features) if fmt.bits == 8 else (torch.uint8, in_features // 2)
        self.register_buffer("qweight", torch.empty(out_features, cols, dtype=qdtype, device=device))
        self.register_buffer("scales", torch.empty(out_features, groups, dtype=torch.float32, device=device))
        offsets = torch.empty(out_features, groups, dtype=torch.float32, device=device) if fmt.bits == 4 else None
        self.register_buffer("offsets", offsets)
        self.bias = (
            nn.Parameter(torch.empty(out_features, dtype=dtype, device=device), requires_grad=False) if bias else None
        )
        self.panel_layout = False  # buffers hold the panel layout (use_panels) instead of the row layout
        self._filling: QuantizedTensor | None = None  # panel buffers that parts of the weight are loaded into
        self._filled: list[slice] = []  # the rows of _filling loaded so far
        self._kernel = None  # (M, in) float32 -> (M, out) with this weight bound; False: no CPU kernel
        self._silu_kernel = None  # the same with silu(gate) * up after it (silu_mul)

    @staticmethod
    def supports(in_features: int, fmt: WeightFormat) -> bool:
        group = fmt.group_size or in_features
        return in_features % BLOCK == 0 and in_features % group == 0

    @property
    def stored_q(self) -> QuantizedTensor:
        """The buffers as they are: row layout, or panel layout after ``use_panels``."""
        return QuantizedTensor(self.fmt.bits, self.qweight, self.scales, self.offsets, self.group_size)

    @property
    def weight_q(self) -> QuantizedTensor:
        """The weight in the row layout (formats.py), whatever the buffers hold."""
        return panels.from_panels(self.stored_q) if self.panel_layout else self.stored_q

    def rows_q(self, index: torch.Tensor) -> QuantizedTensor:
        """Rows `index` (1-D) in the row layout, without unpacking the rest."""
        return panels.rows(self.stored_q, index) if self.panel_layout else self.stored_q.rows(index)

    def use_panels(self) -> bool:
        """Re-lay the weight for the panel kernels where they run; True if it did."""
        self._rows_from_filling()  # a weight loaded in part only
        if (
            self.panel_layout
            or self.qweight.device.type != "cpu"
            or not kernels.panels_available()
            or not panels.fits(self.stored_q)
        ):
            return self.panel_layout
        self._take_panels(panels.to_panels(self.stored_q))
        return True

    def _take_panels(self, packed: QuantizedTensor) -> None:
        self.qweight, self.scales, self.offsets = packed.data, packed.scales, packed.offsets
        self.panel_layout = True
        self._filling, self._filled = None, []
        self._forget_kernels()

    @property
    def pairs_gate_up(self) -> bool:
        """`silu_mul` runs in the kernel call: the weight is in the panel layout on the CPU, its
        gate and up halves whole panels."""
        return self.panel_layout and self.out_features % 32 == 0 and self._kernels_here()

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor:
        """For a gate_up weight (gate rows, then up rows): x (..., in) -> silu(gate) * up (..., out / 2)
        in x's dtype, computed in float32; the same bits as forward then fused.silu_mul."""
        if self._silu_kernel is None:
            self._silu_kernel = self._bind_kernel(silu_mul=True)
        assert self._silu_kernel  # callers check pairs_gate_up: the kernels run here
        y = self._silu_kernel(float_rows(x, self.in_features)).to(x.dtype)
        return y if x.dim() == 2 else y.view(*x.shape[:-1], self.out_features // 2)

    def _kernels_here(self) -> bool:
        """The compiled kernels run where this weight is (the CPU, a compiler)."""
        return self.qweight.device.type == "cpu" and kernels.available()

    def _bind_kernel(self, silu_mul: bool = False):
        """The compiled kernel for this weight as one callable ``x2 -> y`` (with `silu_mul`, ``x2 ->
        silu(gate) * up``), or False where there is none (a GPU, no compiler): bound once, so a
        decode step's 100+ calls skip the lookups."""
        if not self._kernels_here():
            return False
        bias = None if self.bias is None else self.bias.float()
        return kernels.bind(self.stored_q, bias, self.panel_layout, silu_mul)

    def _forget_kernels(self) -> None:
        """Bind the kernels again on next use: they hold the buffers and a float32 copy of the bias."""
        self._kernel = self._silu_kernel = None

    def _apply(self, fn, recurse=True):
        self._forget_kernels()  # .to() / .float() may replace the buffers the kernels hold
        return super()._apply(fn, recurse)

    def _load_from_state_dict(self, *args, **kwargs):
        self._forget_kernels()  # a float32 copy of a bfloat16 bias would go stale
        super()._load_from_state_dict(*args, **kwargs)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self.panel_layout:  # checkpoints always hold the row layout
            rows = self.weight_q
            destination[prefix + "qweight"], destination[prefix + "scales"] = rows.data, rows.scales
            if rows.offsets is not None:
                destination[prefix + "offsets"] = rows.offsets

    def load_weight(self, tensor: torch.Tensor | QuantizedTensor, rows: slice | None = None) -> None:
        """Fill rows `rows` (all by default) from a float tensor or a QuantizedTensor.

        A QuantizedTensor already in this layer's format, or GGUF blocks that are this format
        as they stand (gguf/blocks.py), is copied as is; anything else is (dequantized and)
        quantized into this layer's format.
        """
        if isinstance(tensor, GGMLTensor):
            exact = exact_format(tensor.kind) == self.fmt
            if exact and self._load_blocks_as_panels(tensor, rows):
                return
            tensor = to_quantized(tensor) if exact else tensor.dequantize()
        if self.panel_layout:
            raise RuntimeError("load weights before use_panels() re-lays them")
        self._rows_from_filling()
        rows = rows if rows is not None else slice(None)
        target = self.weight_q.rows(rows)
        if not (
            isinstance(tensor, QuantizedTensor)
            and tensor.bits == self.fmt.bits
            and tensor.group_size == self.group_size
        ):
            dense = tensor.dequantize() if isinstance(tensor, QuantizedTensor) else tensor
            if tuple(dense.shape) != target.shape:
                raise ValueError(f"weight shape {tuple(dense.shape)} does not match {target.shape}")
            tensor = quantize(dense, self.fmt.bits, self.fmt.group_size)
        if tensor.shape != target.shape:
            raise ValueError(f"weight shape {tensor.shape} does not match {target.shape}")
        target.data.copy_(tensor.data)
        target.scales.copy_(tensor.scales)
        if target.offsets is not None:
            assert tensor.offsets is not None  # int4 like the target: it has offsets
            target.offsets.copy_(tensor.offsets)

    def _load_blocks_as_panels(self, tensor: GGMLTensor, rows: slice | None) -> bool:
        """Take rows `rows` (all by default) from GGUF blocks of this format straight into the
        panel layout; False (nothing taken) where the panel kernels do not run it.

        A fused weight (qkv, gate_up) arrives in parts: each part whose rows are whole panels
        is re-laid into panel buffers (one C++ pass, ``blocks.relay_into_panels``), which
        become the weight once every row is in. Without that kernel, a whole weight is re-laid
        a chunk of rows at a time. The same values as load_weight + use_panels, without a
        row-layout copy beside the panels (a 151,936-row Q8_0 head: ~300 MB of load-time peak)."""
        start, stop, _ = (rows or slice(None)).indices(self.out_features)
        if (
            self.panel_layout
            or tensor.shape != (stop - start, self.in_features)
            or start % panels.PANEL
            or stop % panels.PANEL
            or not kernels.panels_available()
        ):
            return False
        if self._filling is None:
            self._filling = panels.empty(self.fmt.bits, self.out_features, self.in_features, self.group_size)
        if relay_into_panels(tensor, self._filling, start // panels.PANEL):
            self._filled.append(slice(start, stop))
            if sum(part.stop - part.start for part in self._filled) == self.out_features:
                self._take_panels(self._filling)
            return True
        if not self._filled:
            self._filling = None
        if (start, stop) != (0, self.out_features):
            return False
        packed = panels.from_row_chunks(lambda part: to_quantized(tensor.rows(part)), self.out_features)
        if packed is None:
            return False
        self._take_panels(packed)
        return True

    def _rows_from_filling(self) -> None:
        """Before a part is written in the row layout: the parts already in panel buffers are
        moved to the row layout too (a weight whose parts do not all take the panel route)."""
        if self._filling is None:
            return
        for rows in self._filled:
            part = panels.from_panels(panels.panel_rows(self._filling, rows))
            self.qweight[rows] = part.data
            self.scales[rows] = part.scales
            if self.offsets is not None:
                assert part.offsets is not None  # int4 panels have offsets
                self.offsets[rows] = part.offsets
        self._filling, self._filled = None, []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # (M, in) already: no reshape and view around the kernel (two of a decode layer's ~16
        # op calls per projection; each costs a replayed tape a dispatcher call)
        flat = x.dim() == 2
        x2 = x if flat else x.reshape(-1, self.in_features)  # (M, in)
        if self._kernel is None:
            self._kernel = self._bind_kernel()
        if self._kernel and x2.device.type == "cpu":
            if x2.dtype == torch.float32 and x2.is_contiguous():
                y = self._kernel(x2)
                return y if flat else y.view(*x.shape[:-1], self.out_features)
            y = self._kernel(x2.float().contiguous()).to(x.dtype)
        else:
            y = F.linear(x2, self.weight_q.dequantize().to(x.dtype), self.bias)
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"format={self.fmt.name}, bias={self.bias is not None}"
        )


class QuantizedEmbedding(nn.Module):
    """The input embedding of a tied model whose output projection is quantized.

    Reads rows of the output projection's quantized weight and dequantizes only
    those, so the vocabulary matrix is stored once, quantized.
    """

    def __init__(self, tied: QuantizedLinear, dtype: torch.dtype) -> None:
        super().__init__()
        self._tied = [tied]  # a list: not registered as a submodule, not saved twice
        self.dtype = dtype

    def load_weight(self, tensor: torch.Tensor | QuantizedTensor, rows: slice | None = None) -> None:
        self._tied[0].load_weight(tensor, rows)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        tied, flat = self._tied[0], ids.reshape(-1)
        if tied.panel_layout and tied._kernels_here():  # one native call (~15 torch ops otherwise)
            rows = kernels.panel_rows(tied.stored_q, flat)
        else:
            rows = tied.rows_q(flat).dequantize()  # (numel, hidden)
        return rows.to(self.dtype).view(*ids.shape, -1)


def quantize_structure(
    model: nn.Module,
    format_of: Callable[[str], WeightFormat | str | None],
    embedding_name: str,
    tied: bool,
    dtype: torch.dtype,
) -> list[str]:
    """Swap every nn.Linear that `format_of(name)` gives a format for; returns the swapped names.

    Call on a model built on the meta device, before its tensors are allocated. ``GGML_BLOCKS``
    makes a GGMLLinear. With tied embeddings and a quantized output projection, the input
    embedding becomes a QuantizedEmbedding / GGMLEmbedding that reads the projection's rows;
    an untied embedding that `format_of` gives ``GGML_BLOCKS`` keeps its own blocks.
    """
    swapped = []
    for name, mod in list(model.named_modules()):
        if not isinstance(mod, nn.Linear) or (fmt := format_of(name)) is None:
            continue
        if fmt == GGML_BLOCKS:
            model.set_submodule(
                name,
                GGMLLinear(mod.in_features, mod.out_features, mod.bias is not None, dtype, device=mod.weight.device),
            )
            swapped.append(name)
            continue
        assert isinstance(fmt, WeightFormat)  # GGML_BLOCKS is the one string format_of gives
        if not QuantizedLinear.supports(mod.in_features, fmt):
            log.warning("%s stays float: in_features %d does not fit %s", name, mod.in_features, fmt.name)
            continue
        model.set_submodule(
            name,
            QuantizedLinear(
                mod.in_features, mod.out_features, mod.bias is not None, fmt, dtype, device=mod.weight.device
            ),
        )
        swapped.append(name)
    embedding = cast(nn.Embedding, model.get_submodule(embedding_name))  # the loop swaps Linears only
    if tied and "lm_head" in swapped:
        head = model.get_submodule("lm_head")
        tied_embedding = (
            GGMLEmbedding(embedding.num_embeddings, embedding.embedding_dim, dtype, head)
            if isinstance(head, GGMLLinear)
            else QuantizedEmbedding(cast(QuantizedLinear, head), dtype)
        )
        model.set_submodule(embedding_name, tied_embedding)
    elif not tied and format_of(embedding_name) == GGML_BLOCKS:
        model.set_submodule(embedding_name, GGMLEmbedding(embedding.num_embeddings, embedding.embedding_dim, dtype))
    return swapped


def use_panels(model: nn.Module) -> int:
    """Re-lay every QuantizedLinear that the panel kernels take (AVX-512 VNNI, AVX2); returns how many."""
    return sum(m.use_panels() for m in model.modules() if isinstance(m, QuantizedLinear))


def quantized_targets(model: nn.Module) -> dict[str, QuantizedLinear | QuantizedEmbedding | GGMLLinear | GGMLEmbedding]:
    """Checkpoint weight name ('<module>.weight') -> the quantized module that loads it (and any
    module that says it ``loads_own_weight``: layers/grouped.py)."""
    return {
        f"{name}.weight": mod
        for name, mod in model.named_modules()
        if isinstance(mod, (QuantizedLinear, QuantizedEmbedding, GGMLLinear, GGMLEmbedding))
        or getattr(mod, "loads_own_weight", False)
    }
