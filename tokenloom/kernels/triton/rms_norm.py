"""RMSNorm, alone or after the residual add, in Triton: one program per row.

The arithmetic is torch's (models/layers.RMSNorm.forward_native): the sum residual + x rounded
to the activations' dtype (it is the new residual stream), then in float32 x * rsqrt(mean(x^2)
+ eps), rounded to the dtype, times the weight, rounded again.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenloom.kernels.triton import next_power_of_2


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    residual_out_ptr,
    eps,
    stride_x,
    stride_r,
    stride_o,
    stride_ro,
    N: tl.constexpr,
    BLOCK: tl.constexpr,
    ADD: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < N
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
    if ADD:
        total = (
            x.to(tl.float32) + tl.load(residual_ptr + row * stride_r + cols, mask=ok, other=0.0).to(tl.float32)
        ).to(x.dtype)
        tl.store(residual_out_ptr + row * stride_ro + cols, total, mask=ok)
        x = total
    x32 = x.to(tl.float32)
    normed = (x32 * tl.rsqrt(tl.sum(x32 * x32, 0) / N + eps)).to(x.dtype)
    w = tl.load(weight_ptr + cols, mask=ok, other=0.0)
    out = (w.to(tl.float32) * normed.to(tl.float32)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_o + cols, out, mask=ok)


def _launch(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor | None]:
    rows, n = x.shape
    out_dtype = torch.promote_types(weight.dtype, x.dtype)  # torch's weight * x.to(dtype)
    out = torch.empty(rows, n, dtype=out_dtype, device=x.device)
    new_residual = torch.empty_like(x) if residual is not None else None
    if rows:
        r = residual if residual is not None else x
        ro = new_residual if new_residual is not None else out
        _rms_norm_kernel[(rows,)](
            x,
            r,
            weight,
            out,
            ro,
            float(eps),
            x.stride(0),
            r.stride(0),
            out.stride(0),
            ro.stride(0),
            N=n,
            BLOCK=next_power_of_2(n),
            ADD=residual is not None,
            num_warps=4 if n <= 4096 else 8,
        )
    return out, new_residual


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x (rows, N), unit column stride -> weight * x / sqrt(mean(x^2) + eps)."""
    return _launch(x, None, weight, eps)[0]


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual (rows, N) -> (rms_norm(residual + x), residual + x)."""
    out, new_residual = _launch(x, residual, weight, eps)
    assert new_residual is not None  # a residual in: its sum out
    return out, new_residual
