"""The sampler's vectorized float32 CPU passes over logit rows (``csrc/select_cpu.cpp``): the
finite logits' statistics top-n-sigma cuts by, each row's k largest logits, its log-sum-exp, and
how many of its logits reach a floor and which. Each reads the row once or twice and allocates nothing of
its size (torch's logsumexp makes four passes and two row-sized temporaries, several times
slower: docs/BENCHMARKS.md, 'Measurements behind design choices'). Used only where
``enabled(x)``: float32 CPU rows of unit stride with the kernels compiled; elsewhere the
callers take plain torch (same results up to float rounding and the order of tied entries).
"""

from __future__ import annotations

from pathlib import Path

import torch

from tokenloom.kernels import native
from tokenloom.layers import fused

_SOURCE = Path(__file__).parent / "csrc" / "select_cpu.cpp"
TOP_K_SHARE = 16  # row_top_k only for k <= V / TOP_K_SHARE; past that torch.topk's selection wins


def enabled(x: torch.Tensor) -> bool:
    """x is float32 CPU (B, V) with unit-stride rows and the kernels are compiled (built on first use)."""
    return x.dtype == torch.float32 and x.device.type == "cpu" and x.dim() == 2 and x.stride(1) == 1 and build()


def build() -> bool:
    """Compile (once, ~15 s; `make setup` does it ahead) and register the kernels: False where they
    cannot be built here."""
    return native.load(_SOURCE, "sampler selection kernels")


def row_finite_stats(x: torch.Tensor) -> torch.Tensor:
    """x (B, V) -> (B, 4): count, mean, population std and max of each row's entries that are not
    -inf (two passes: the deviation is summed around the mean)."""
    return torch.ops.tokenloom_select.row_finite_stats(x)


def top_k(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x (B, V), 1 <= k <= V -> (values (B, k), columns (B, k)): each row's k largest, largest
    first, as torch.topk (whose order among tied entries is its own)."""
    if enabled(x) and k * TOP_K_SHARE <= x.shape[1]:
        return torch.ops.tokenloom_select.row_top_k(x, k)
    return x.topk(k, dim=-1)


def logsumexp(x: torch.Tensor) -> torch.Tensor:
    """x (B, V) -> (B, 1): log sum exp of each row (-inf entries add nothing)."""
    if enabled(x):
        return torch.ops.tokenloom_select.row_logsumexp(x)[:, None]
    return torch.logsumexp(x, -1, keepdim=True)


def count_at_least(x: torch.Tensor, floor: torch.Tensor) -> torch.Tensor:
    """x (B, V), floor (B, 1) -> (B,) int64: how many of each row's entries are >= its floor."""
    if enabled(x) and floor.dtype == x.dtype:
        return torch.ops.tokenloom_select.row_count_at_least(x, floor)
    return (x >= floor).sum(-1)


def at_least(x: torch.Tensor, floor: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x (B, V), floor (B, 1), width >= every row's count_at_least -> (values (B, width), columns
    (B, width)): each row's entries >= its floor, then columns below it (values -inf) to `width`;
    every column named once per row."""
    if enabled(x) and floor.dtype == x.dtype:
        return torch.ops.tokenloom_select.row_at_least(x, floor, width)
    keep = x >= floor
    if x.shape[0] and int(keep.sum(-1).max()) > width:
        raise ValueError(f"at_least: a row has more than width={width} entries at its floor or above")
    columns = keep.to(torch.int8).sort(dim=-1, descending=True, stable=True).indices[:, :width]  # kept first
    values = x.gather(1, columns)
    return values.masked_fill(~keep.gather(1, columns), float("-inf")), columns


def argmax(x: torch.Tensor) -> torch.Tensor:
    """x (B, V) -> (B,) int64: argmax over the last dim (the first index among equal maxima, NaN
    the maximum, like torch.argmax). Float32 CPU rows: the fused decoder ops' kernel, in which
    each core scans the columns its half of the LM head just wrote (much cheaper than max() in a
    serving step); else max(), on the CPU faster than argmax (docs/BENCHMARKS.md, 'Measurements
    behind design choices')."""
    if x.dim() == 2 and x.shape[1] > 0 and x.stride(1) == 1 and fused.enabled(x):
        return fused.row_argmax(x)
    return x.max(dim=-1).indices
