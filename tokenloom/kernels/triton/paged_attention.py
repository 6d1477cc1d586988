"""Paged attention in Triton: every query of a ragged batch against its sequence's cached keys
and values, read in place through the block table (no gather, no padding to the longest).

One kernel serves decode (one query per sequence), prompt chunks and mixed steps, prefix-cache
hits included (a chunk's queries sit at the end of its context). A program takes up to BLOCK_Q
query tokens of one sequence and every query head of one KV head (GQA: the group's heads share
each key tile), so its M = BLOCK_Q x BLOCK_G rows go through the matrix units together. It
walks the context in tiles of BLOCK_N positions, each position's slot found through the block
table, with an online softmax (float32 statistics and accumulator). Causal, sliding-window
(a query sees its last `window` positions) and soft-capped scores (tanh(s / cap) * cap, as
Gemma 2), and attention sinks (a per-head logit that joins the softmax's denominator with no
value, as gpt-oss) are options.

The block table is flat: sequence i's blocks are ``block_ids[block_offsets[i] : ...]``, so a
step's table costs the blocks it names, not sequences x the longest table (what the CUDA graph
runner copies each step).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenloom.attention.metadata import PagedInputs
from tokenloom.kernels.triton import next_power_of_2


@triton.jit
def _tanh(x):
    """tanh from exp (libdevice's is not in Triton's interpreter): exact in sign, |error| ~1e-7."""
    t = tl.exp(-2.0 * tl.abs(x))
    y = (1.0 - t) / (1.0 + t)
    return tl.where(x < 0, -y, y)


@triton.jit
def _paged_attention_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    sinks_ptr,
    seq_lens_ptr,
    query_start_ptr,
    block_offsets_ptr,
    block_ids_ptr,
    scale,
    softcap,
    window,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGE: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    seq = tl.program_id(0)
    q_block = tl.program_id(1)
    kv_head = tl.program_id(2)
    q_start = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_start
    if q_block * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    first_pos = seq_len - q_len  # position of the sequence's first query
    table = block_ids_ptr + tl.load(block_offsets_ptr + seq)

    rows = tl.arange(0, BLOCK_Q * BLOCK_G)  # row = (query token, head of the group)
    token = q_block * BLOCK_Q + rows // BLOCK_G
    group_head = rows % BLOCK_G
    row_ok = (token < q_len) & (group_head < GROUP)
    head = kv_head * GROUP + group_head
    q_pos = first_pos + token  # each row's position in its sequence
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < HEAD_DIM
    q = tl.load(
        q_ptr + (q_start + token)[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :],
        mask=row_ok[:, None] & dim_ok[None, :],
        other=0.0,
    )  # (M, BLOCK_D)

    m_i = tl.full((BLOCK_Q * BLOCK_G,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_Q * BLOCK_G,), tl.float32)
    acc = tl.zeros((BLOCK_Q * BLOCK_G, BLOCK_D), tl.float32)
    last_pos = tl.minimum(first_pos + (q_block + 1) * BLOCK_Q, seq_len)  # past this block's last query
    start = 0
    if HAS_WINDOW:  # the block's first query sees positions after first_q - window
        start = tl.maximum(first_pos + q_block * BLOCK_Q - window + 1, 0) // BLOCK_N * BLOCK_N
    for n0 in range(start, last_pos, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        pos_ok = pos < last_pos
        block = tl.load(table + pos // PAGE, mask=pos_ok, other=0).to(tl.int64)
        slot = pos % PAGE
        kv_ok = pos_ok[:, None] & dim_ok[None, :]
        k = tl.load(
            k_cache_ptr + block[:, None] * stride_kb + slot[:, None] * stride_ks + kv_head * stride_kh + dims[None, :],
            mask=kv_ok,
            other=0.0,
        )  # (BLOCK_N, BLOCK_D)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale  # (M, BLOCK_N)
        if HAS_SOFTCAP:
            s = _tanh(s / softcap) * softcap
        visible = (pos[None, :] <= q_pos[:, None]) & pos_ok[None, :]
        if HAS_WINDOW:
            visible = visible & (pos[None, :] > q_pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that sees nothing yet
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            v_cache_ptr + block[:, None] * stride_vb + slot[:, None] * stride_vs + kv_head * stride_vh + dims[None, :],
            mask=kv_ok,
            other=0.0,
        )  # (BLOCK_N, BLOCK_D)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    if HAS_SINKS:  # exp(sink) joins the denominator: rescale both to max(m, sink)
        sink = tl.load(sinks_ptr + head, mask=row_ok, other=0.0).to(tl.float32)
        m_all = tl.maximum(m_i, sink)
        shrink = tl.exp(m_i - m_all)
        acc = acc * shrink[:, None]
        l_i = l_i * shrink + tl.exp(sink - m_all)
    l_i = tl.where(l_i == 0.0, 1.0, l_i)  # padding rows (no context): zeros, not NaN
    out = acc / l_i[:, None]
    tl.store(
        out_ptr + (q_start + token)[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None] & dim_ok[None, :],
    )


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    inputs: PagedInputs,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of q (T, heads, head_dim), any row stride, unit last stride (a view of the step's
    qkv), against caches (num_blocks, block_size, kv_heads, head_dim) -> out (T, heads, head_dim).
    The step's keys and values must be in the cache already. sinks: (heads,) logits or None."""
    T, heads, head_dim = q.shape
    _, page, kv_heads, _ = k_cache.shape
    if out is None:
        out = torch.empty(T, heads, head_dim, dtype=q.dtype, device=q.device)
    group = heads // kv_heads
    block_g = next_power_of_2(group)
    rows = 16 if inputs.max_query_len == 1 else 64  # rows a program computes (tl.dot: at least 16)
    block_q = max(1, rows // block_g)
    # Positions per iteration: each iteration waits on a gather of block ids, then the tile's
    # loads, so a decode program's time is mostly its iteration count (with 32 positions a tile,
    # attention was a large share of a 135M model's step: docs/BENCHMARKS.md, 'Measurements behind
    # design choices').
    block_d = next_power_of_2(max(head_dim, 16))
    block_n = 64 if block_d <= 128 else 32
    grid = (inputs.seq_lens.shape[0], triton.cdiv(inputs.max_query_len, block_q), kv_heads)
    _paged_attention_kernel[grid](
        q,
        k_cache,
        v_cache,
        out,
        sinks if sinks is not None else q,
        inputs.seq_lens,
        inputs.query_start,
        inputs.block_offsets,
        inputs.block_ids,
        float(scale),
        float(softcap or 1.0),
        int(window or 0),
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        GROUP=group,
        BLOCK_G=block_g,
        BLOCK_Q=block_q,
        BLOCK_N=block_n,
        PAGE=page,
        HAS_WINDOW=window is not None,
        HAS_SOFTCAP=softcap is not None,
        HAS_SINKS=sinks is not None,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else None,  # float32: no tf32 rounding
        num_warps=4,
    )
    return out
