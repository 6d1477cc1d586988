"""Each row of a step adds its own adapter's low-rank product: the batched LoRA op.

``lora_add(y, x, A, B, ranks, rows, bounds)`` -> y + the LoRA delta of every row, where row t
uses adapter slot ``rows[t]`` (-1: none; `rows` may run past T, only its first T are read).
Shapes: x (T, K), y (T, N); A (S, G*R, K) and B (S, R, N) (each slot's B transposed) hold S
slots' adapters (float32, bfloat16 or float16), scaling folded into B; ranks (S, G) int32 the
rank each slot has in each of G output groups (``bounds``: G + 1 column offsets; a fused q/k/v
projection has three groups, each shard its own A and B). On the CPU with float32 activations it
is one compiled call (``csrc/lora_cpu.cpp``, punica's BGMV: every row its own adapter, nothing
read from Python); elsewhere rows are gathered per adapter for two matmuls a group
(``lora_add_torch``).
"""

from __future__ import annotations

from pathlib import Path

import torch

from tokenloom.kernels import native

_SOURCE = Path(__file__).parent / "csrc" / "lora_cpu.cpp"


def kernel_built() -> bool:
    """The compiled op is registered (built on first use; False without a toolchain or AVX2)."""
    return native.load(_SOURCE, "batched LoRA kernel")


def kernel_runs(dtype: torch.dtype, device: torch.device) -> bool:
    """The compiled op takes activations of `dtype` on `device` (else the torch fallback, which reads
    the step's rows on the host: no decode tapes then)."""
    return device.type == "cpu" and dtype == torch.float32 and kernel_built()


def kernel_takes(x: torch.Tensor) -> bool:
    """The compiled op runs on float32 CPU activations (the factors float32, bfloat16 or float16)."""
    return kernel_runs(x.dtype, x.device)


def lora_add(
    y: torch.Tensor,
    x: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    ranks: torch.Tensor,
    rows: torch.Tensor,
    bounds: list[int],
) -> torch.Tensor:
    """y (T, N) + every row's LoRA delta of x (T, K), as a new tensor (see the module docstring)."""
    if kernel_takes(x) and y.dtype == torch.float32:
        return torch.ops.tokenloom_lora.lora_add(y, x, A, B, ranks, rows, bounds)
    return lora_add_torch(y, x, A, B, ranks, rows, bounds)


def lora_add_torch(
    y: torch.Tensor,
    x: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    ranks: torch.Tensor,
    rows: torch.Tensor,
    bounds: list[int],
) -> torch.Tensor:
    """The reference: per adapter slot in the step, its rows gathered, (x A_g^T) B_g^T added to each
    group's columns in float32, the sum cast back to y's dtype."""
    out = y.float()  # a copy where y is not float32
    if out is y:
        out = y.clone()
    R = B.shape[1]
    groups = len(bounds) - 1
    rank_of = ranks.tolist()
    rows = rows[: x.shape[0]]
    for slot in sorted(set(rows.tolist()) - {-1}):
        picked = (rows == slot).nonzero().squeeze(1)  # (t,) the rows of this adapter
        xs = x.index_select(0, picked).float()  # (t, K)
        delta = torch.zeros(len(picked), y.shape[1], dtype=torch.float32, device=y.device)
        for g in range(groups):
            r = rank_of[slot][g]
            if r:
                a = A[slot, g * R : g * R + r].float()  # (r, K)
                b = B[slot, :r, bounds[g] : bounds[g + 1]].float()  # (r, n_g)
                delta[:, bounds[g] : bounds[g + 1]] = (xs @ a.T) @ b
        out.index_add_(0, picked, delta)
    return out.to(y.dtype)
