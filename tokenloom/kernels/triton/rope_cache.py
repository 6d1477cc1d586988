"""Rotary embedding and the KV-cache write in one Triton kernel.

One program per (token, head) of the step's qkv (T, (heads + 2 kv_heads) head_dim): a query
head is rotated in place in qkv (attention then reads q from there), a KV head's key is rotated
and written to its cache slot with its value. Rotate-half RoPE over the first rotary_dim dims
of a head (partial rotary: the rest pass through), with each product rounded to the activations'
dtype before the sum, as torch's ``x * cos + rotate_half(x) * sin`` rounds. A slot of -1 (a
padding row of a CUDA graph) writes nothing.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenloom.kernels.triton import next_power_of_2


@triton.jit
def _rotate(x_ptr, cos_ptr, sin_ptr, dims, HEAD_DIM: tl.constexpr, ROTARY: tl.constexpr, HAS_ROPE: tl.constexpr):
    """The head at x_ptr (HEAD_DIM,), rotated over its first ROTARY dims (float32 values of x's dtype)."""
    x = tl.load(x_ptr + dims, mask=dims < HEAD_DIM, other=0.0)
    if HAS_ROPE:
        half = ROTARY // 2
        turned = dims < ROTARY
        partner = tl.where(dims < half, dims + half, dims - half)
        x_partner = tl.load(x_ptr + partner, mask=turned, other=0.0).to(tl.float32)
        rotated = tl.where(dims < half, -x_partner, x_partner)
        c = tl.load(cos_ptr + dims, mask=turned, other=1.0).to(tl.float32)
        s = tl.load(sin_ptr + dims, mask=turned, other=0.0).to(tl.float32)
        a = (x.to(tl.float32) * c).to(x.dtype).to(tl.float32)
        b = (rotated * s).to(x.dtype).to(tl.float32)
        x = tl.where(turned, (a + b).to(x.dtype), x)
    return x


@triton.jit
def _rope_cache_kernel(
    qkv_ptr,
    cos_ptr,
    sin_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    stride_qkv,
    stride_cos,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    ROTARY: tl.constexpr,
    PAGE: tl.constexpr,
    HAS_ROPE: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    dims = tl.arange(0, BLOCK_D)
    row = qkv_ptr + t * stride_qkv
    cos_row, sin_row = cos_ptr + t * stride_cos, sin_ptr + t * stride_cos
    if h < NUM_HEADS:
        if HAS_ROPE:
            q = _rotate(row + h * HEAD_DIM, cos_row, sin_row, dims, HEAD_DIM, ROTARY, HAS_ROPE)
            tl.store(row + h * HEAD_DIM + dims, q, mask=dims < HEAD_DIM)
    else:
        slot = tl.load(slot_ptr + t).to(tl.int64)
        if slot >= 0:
            j = h - NUM_HEADS
            k = _rotate(row + (NUM_HEADS + j) * HEAD_DIM, cos_row, sin_row, dims, HEAD_DIM, ROTARY, HAS_ROPE)
            v = tl.load(row + (NUM_HEADS + NUM_KV_HEADS + j) * HEAD_DIM + dims, mask=dims < HEAD_DIM)
            block, offset = slot // PAGE, slot % PAGE
            tl.store(
                k_cache_ptr + block * stride_kb + offset * stride_ks + j * stride_kh + dims,
                k.to(k_cache_ptr.dtype.element_ty),
                mask=dims < HEAD_DIM,
            )
            tl.store(
                v_cache_ptr + block * stride_vb + offset * stride_vs + j * stride_vh + dims,
                v.to(v_cache_ptr.dtype.element_ty),
                mask=dims < HEAD_DIM,
            )


def rope_and_cache(
    qkv: torch.Tensor,
    rope: tuple[torch.Tensor, torch.Tensor] | None,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
) -> torch.Tensor:
    """qkv (T, (heads + 2 kv_heads) head_dim), unit column stride: rotate its query heads in place
    and write each token's rotated key and its value to cache slot slot_mapping[t] (-1: none).
    rope: cos, sin (T, 1, rotary_dim) in qkv's dtype, or None (no rotation: learned positions).
    Returns q, a (T, heads, head_dim) view of qkv."""
    T = qkv.shape[0]
    if T:
        cos, sin = rope if rope is not None else (qkv, qkv)
        rotary = cos.shape[-1] if rope is not None else head_dim
        _rope_cache_kernel[(T, num_heads + num_kv_heads)](
            qkv,
            cos,
            sin,
            k_cache,
            v_cache,
            slot_mapping,
            qkv.stride(0),
            cos.stride(0),
            k_cache.stride(0),
            k_cache.stride(1),
            k_cache.stride(2),
            v_cache.stride(0),
            v_cache.stride(1),
            v_cache.stride(2),
            NUM_HEADS=num_heads,
            NUM_KV_HEADS=num_kv_heads,
            HEAD_DIM=head_dim,
            BLOCK_D=next_power_of_2(head_dim),
            ROTARY=rotary,
            PAGE=k_cache.shape[1],
            HAS_ROPE=rope is not None,
            num_warps=1,
        )
    return qkv[:, : num_heads * head_dim].view(T, num_heads, head_dim)
