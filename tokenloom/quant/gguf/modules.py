"""nn.Linear / nn.Embedding drop-ins whose weights are GGUF blocks, values as stored.

``GGMLLinear`` keeps nn.Linear's contract, ``x (..., in) -> (..., out)`` in x's dtype. A
fused layer (qkv, gate_up) may take its shards from tensors of different GGML types: each
shard is a segment of output columns, loaded into the fastest layout its type has here
(``segment_for``) and filled by its own kernel. ``GGMLEmbedding`` keeps the embedding's
blocks and dequantizes only the rows it looks up (or reads a tied GGMLLinear's rows).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn

from tokenloom.memory import huge_pages
from tokenloom.quant.gguf import panels as gguf_panels
from tokenloom.quant.gguf.blocks import exact_format, to_quantized
from tokenloom.quant.gguf.panels import GGUFPanels
from tokenloom.quant.gguf.tensor import GGMLTensor, ops
from tokenloom.quant.int8 import kernels, panels
from tokenloom.quant.int8.formats import QuantizedTensor


class QuantizedSegment:
    """A GGUF tensor held as a tokenloom int8/int4 panel tensor (values unchanged)."""

    def __init__(self, q: QuantizedTensor, kind: int, type_name: str, shape: tuple[int, int]) -> None:
        self.q, self.kind, self.type_name, self.shape = q, kind, type_name, shape  # q in the panel layout
        self._run = kernels.bind(q, None, True)

    @classmethod
    def of(cls, t: GGMLTensor) -> QuantizedSegment | None:
        """`t` re-laid as int8/int4 panels, or None where the panel layout cannot hold it (panels.fits)."""
        q = to_quantized(t)
        return cls(panels.to_panels(q), t.kind, t.type_name, t.shape) if panels.fits(q) else None

    @property
    def nbytes(self) -> int:
        return self.q.nbytes

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.q.data, self.q.scales, self.q.offsets) if t is not None]

    def matmul_into(self, out: torch.Tensor, col0: int, x: torch.Tensor) -> None:
        out[:, col0 : col0 + self.shape[0]] = self._run(x)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None, silu_mul: bool = False) -> torch.Tensor:
        """x (M, K) float32 contiguous -> x @ w.T + bias (M, N) in one call, or with `silu_mul`
        silu(gate) * up (M, N/2) for a gate_up weight (gate rows first)."""
        return kernels.bind(self.q, bias, True, silu_mul)(x)

    def followed_by(self, other: QuantizedSegment) -> QuantizedSegment | None:
        """These rows then `other`'s as one segment (panels stack along their first dimension),
        or None where the formats differ."""
        a, b = self.q, other.q
        if (a.bits, a.group_size, self.kind, self.shape[1]) != (b.bits, b.group_size, other.kind, other.shape[1]):
            return None
        offsets = None
        if a.offsets is not None:
            assert b.offsets is not None  # the same format: the same parts
            offsets = huge_pages.cat(a.offsets, b.offsets)
        # into the load's arena, as the panels' own buffers
        merged = QuantizedTensor(
            a.bits, huge_pages.cat(a.data, b.data), huge_pages.cat(a.scales, b.scales), offsets, a.group_size
        )
        return QuantizedSegment(merged, self.kind, self.type_name, (self.shape[0] + other.shape[0], self.shape[1]))

    def rows(self, index: torch.Tensor) -> torch.Tensor:
        return panels.rows(self.q, index).dequantize()


def segment_for(t: GGMLTensor, whole: bool = True):
    """`t` in the fastest layout this CPU runs: GGUF panels, int8/int4 panels, or as stored.
    `whole`: `t` is its layer's whole weight; a part (a fused gate_up's gate) is re-laid on the heap
    (``huge_pages.outside_arena``), since joining it to the other parts copies it into the arena."""
    with contextlib.nullcontext() if whole else huge_pages.outside_arena():
        if gguf_panels.fits(t):
            return gguf_panels.to_panels(t)
        fmt = exact_format(t.kind)
        if fmt is not None and kernels.panels_available() and t.shape[0] % panels.PANEL == 0:
            return QuantizedSegment.of(t) or t
        return t


def _merge_adjacent(segments: list[tuple[int, Any]], out_features: int) -> list[tuple[int, Any]]:
    """Segments sorted by first column, each run of touching ones of one layout and type
    joined (a fused qkv or gate_up of one type becomes one kernel call); a join that makes up the
    whole weight (`out_features` rows) lands in the load's huge-page arena, a partial one on the heap."""
    merged: list[tuple[int, Any]] = []
    for col0, segment in segments:
        if merged:
            prev0, prev = merged[-1]
            touching = type(prev) is type(segment) and hasattr(prev, "followed_by") and prev0 + prev.shape[0] == col0
            joined = None
            if touching:
                whole = prev.shape[0] + segment.shape[0] == out_features
                with contextlib.nullcontext() if whole else huge_pages.outside_arena():
                    joined = prev.followed_by(segment)
            if joined is not None:
                merged[-1] = (prev0, joined)
                continue
        merged.append((col0, segment))
    return merged


def float_rows(x: torch.Tensor, width: int) -> torch.Tensor:
    """x (..., width) as a contiguous float32 (M, width) matrix."""
    x2 = x if x.dim() == 2 else x.reshape(-1, width)
    return x2 if x2.dtype == torch.float32 and x2.is_contiguous() else x2.float().contiguous()


def _rows(segment, index: torch.Tensor) -> torch.Tensor:
    return segment.rows(index).dequantize() if isinstance(segment, GGMLTensor) else segment.rows(index)


class GGMLLinear(nn.Module):
    """A Linear layer whose weight is one or more GGUF tensors, each a segment of output rows."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.segments: list[tuple[int, Any]] = []  # (first output column, segment), sorted
        self.bias = (
            nn.Parameter(torch.empty(out_features, dtype=dtype, device=device), requires_grad=False) if bias else None
        )

    def load_weight(self, tensor: GGMLTensor, rows: slice | None = None) -> None:
        """Take `tensor` as the weight's rows `rows` (all rows when None), values unchanged."""
        if not isinstance(tensor, GGMLTensor):
            raise ValueError(f"a GGML layer takes GGUF blocks, got a {type(tensor).__name__}")
        start, stop = (0, self.out_features) if rows is None else (rows.start or 0, rows.stop)
        if tensor.shape != (stop - start, self.in_features):
            raise ValueError(f"weight shape {tensor.shape} does not match {(stop - start, self.in_features)}")
        kept = [s for s in self.segments if s[0] != start]
        segment = segment_for(tensor, whole=stop - start == self.out_features)
        self.segments = _merge_adjacent(sorted(kept + [(start, segment)], key=lambda s: s[0]), self.out_features)

    def rows(self, index: torch.Tensor) -> torch.Tensor:
        """float32 rows `index` of a one-segment weight (a tied embedding's lookup)."""
        if len(self.segments) != 1:
            raise ValueError("row lookup needs a weight of one GGUF tensor")
        return _rows(self.segments[0][1], index)

    @property
    def pairs_gate_up(self) -> bool:
        """`silu_mul` runs as one kernel call: the weight is one panel tensor (GGUF panels, or int8 /
        int4 panels whose gate and up halves are whole panels of 16 rows)."""
        only = self.segments[0][1] if len(self.segments) == 1 else None
        if isinstance(only, QuantizedSegment):
            return only.shape[0] % 32 == 0
        return isinstance(only, GGUFPanels) and ops() is not None

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor:
        """A gated MLP's gate_up: x (..., in) -> silu(gate) * up (..., out / 2), the same bits as
        forward then fused.silu_mul."""
        x2 = float_rows(x, self.in_features)
        y = self.segments[0][1].linear(x2, self.bias, silu_mul=True).to(x.dtype)
        return y if x.dim() == 2 else y.view(*x.shape[:-1], self.out_features // 2)

    def panel_fields(self) -> tuple[int, list[torch.Tensor | None]] | None:
        """(GGML type, [lo, hi, scale, offset, dsup, msup]) where the weight is one GGUF panel tensor
        without a bias (what the grouped expert kernel takes, moe_token below); else None."""
        only = self.segments[0][1] if len(self.segments) == 1 else None
        if not isinstance(only, GGUFPanels) or self.bias is not None or ops() is None:
            return None
        return only.kind, [only.lo, only.hi, only.scale, only.offset, only.dsup, only.msup]

    def held_tensors(self) -> list[torch.Tensor]:
        """The weight's tensors, which are not registered buffers (layers/op_tape.py asks)."""
        return [t for _, s in self.segments for t in s.tensors()]

    @property
    def types(self) -> list[str]:
        return [s.type_name + ("" if isinstance(s, GGMLTensor) else " panels") for _, s in self.segments]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = float_rows(x, self.in_features)  # (M, in)
        kernels = ops()
        only = self.segments[0][1] if len(self.segments) == 1 else None
        if kernels is not None and x2.device.type == "cpu" and isinstance(only, (QuantizedSegment, GGUFPanels)):
            y = only.linear(x2, self.bias)  # one call, bias included
        else:
            y = self._segments_forward(x2, kernels)
            if self.bias is not None:
                y += self.bias
        if y.dtype != x.dtype:
            y = y.to(x.dtype)
        return y if x.dim() == 2 else y.view(*x.shape[:-1], self.out_features)

    def _segments_forward(self, x2: torch.Tensor, kernels) -> torch.Tensor:
        """x2 (M, in) float32 -> (M, out), each segment by its own kernel (or dequantized off the CPU)."""
        if kernels is None or x2.device.type != "cpu":
            w = torch.cat([_rows(s, torch.arange(s.shape[0])) for _, s in self.segments])
            return x2 @ w.to(x2.device).T
        xq = kernels.quantize_activations(x2)
        y = torch.empty(x2.shape[0], self.out_features)
        for col0, segment in self.segments:
            segment.matmul_into(y, col0, x2 if isinstance(segment, QuantizedSegment) else xq)
        return y

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"types={'+'.join(self.types) or 'unloaded'}, bias={self.bias is not None}"
        )


class GGMLEmbedding(nn.Module):
    """An embedding table of GGUF blocks (its own, or the rows of a tied GGMLLinear)."""

    def __init__(
        self, num_embeddings: int, embedding_dim: int, dtype: torch.dtype, tied: GGMLLinear | None = None
    ) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim, self.dtype = num_embeddings, embedding_dim, dtype
        self._tied = [tied] if tied is not None else []  # a list: not registered, not saved twice
        self.weight_q: GGMLTensor | None = None

    def load_weight(self, tensor: GGMLTensor, rows: slice | None = None) -> None:
        if self._tied:
            self._tied[0].load_weight(tensor, rows)
            return
        if not isinstance(tensor, GGMLTensor) or tensor.shape != (self.num_embeddings, self.embedding_dim):
            raise ValueError(f"embedding takes GGUF blocks of shape {(self.num_embeddings, self.embedding_dim)}")
        self.weight_q = tensor

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1).cpu()
        if self._tied:
            rows = self._tied[0].rows(flat)
        else:
            assert self.weight_q is not None  # load_weight has run
            rows = self.weight_q.rows(flat).dequantize()
        return rows.to(self.dtype).to(ids.device).view(*ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        kind = "tied" if self._tied else (self.weight_q.type_name if self.weight_q is not None else "unloaded")
        return f"{self.num_embeddings}, {self.embedding_dim}, {kind}"


def moe_token(
    x: torch.Tensor, kinds: tuple[int, int], experts: list[tuple[list, list]], weights: list[float]
) -> torch.Tensor:
    """One token x (1, hidden) float32 through gated-MLP experts whose gate_up and down weights are
    GGUF panel tensors (GGMLLinear.panel_fields; `kinds`: their two types, `experts`: each chosen
    expert's gate_up and down fields, in the order to sum) -> (1, hidden) = sum of weight x expert,
    in two kernel passes (csrc/ggml_cpu.cpp panel_moe_token): each expert's output the bits its
    own calls give."""
    fields = [t for gate_up, _ in experts for t in gate_up] + [t for _, down in experts for t in down]
    return ops().panel_moe_token(x, kinds[0], kinds[1], fields, torch.tensor(weights, dtype=torch.float32))
