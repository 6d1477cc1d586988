"""Reference paged attention on torch's scaled_dot_product_attention (any device).

One SDPA call per sequence: simple, exact, and free of cross-sequence padding,
so a sequence's output never depends on its batch companions.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tokenloom.attention.metadata import AttentionMetadata


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Scatter this step's keys/values (T, kv_heads, head_dim) into their cache slots (in place)."""
    num_blocks, block_size, kv_heads, head_dim = k_cache.shape
    k_cache.view(num_blocks * block_size, kv_heads, head_dim).index_copy_(0, slot_mapping, k)
    v_cache.view(num_blocks * block_size, kv_heads, head_dim).index_copy_(0, slot_mapping, v)


def _gather(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """The first `length` cached tokens of a sequence: (kv_heads, length, head_dim)."""
    _, block_size, kv_heads, head_dim = cache.shape
    blocks = cache.index_select(0, block_table)                 # (nb, block_size, kv_heads, head_dim)
    return blocks.view(-1, kv_heads, head_dim)[:length].transpose(0, 1)


def _mask(q_len: int, ctx_len: int, window: int | None, device: torch.device) -> torch.Tensor | None:
    """Boolean (q_len, ctx_len) mask, True = may attend; None when nothing is masked."""
    if q_len == 1 and (window is None or ctx_len <= window):
        return None
    q_pos = torch.arange(ctx_len - q_len, ctx_len, device=device)[:, None]
    k_pos = torch.arange(ctx_len, device=device)[None, :]
    allowed = k_pos <= q_pos
    if window is not None:
        allowed &= k_pos > q_pos - window
    return allowed


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Causal attention of this step's queries against each sequence's cached context.

    q: (T, heads, head_dim); k, v: (T, kv_heads, head_dim); caches:
    (num_blocks, block_size, kv_heads, head_dim). Writes k/v into the caches first,
    then returns (T, heads, head_dim).
    """
    write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
    gqa = q.shape[1] != k.shape[1]
    out = torch.empty_like(q)
    for start, q_len, ctx_len, table in zip(meta.query_start, meta.query_lens,
                                            meta.context_lens, meta.block_tables):
        qi = q[start:start + q_len].transpose(0, 1)[None]         # (1, heads, q_len, head_dim)
        if q_len == ctx_len:   # whole context is this step's: no need to read the cache
            ki = k[start:start + q_len].transpose(0, 1)            # (kv_heads, q_len, head_dim)
            vi = v[start:start + q_len].transpose(0, 1)
        else:
            ki = _gather(k_cache, table, ctx_len)                  # (kv_heads, ctx_len, head_dim)
            vi = _gather(v_cache, table, ctx_len)
        window = meta.sliding_window
        causal_only = q_len == ctx_len and q_len > 1 and (window is None or ctx_len <= window)
        mask = None if causal_only else _mask(q_len, ctx_len, window, q.device)
        oi = F.scaled_dot_product_attention(qi, ki[None], vi[None], attn_mask=mask,
                                            is_causal=causal_only, scale=scale, enable_gqa=gqa)
        out[start:start + q_len] = oi[0].transpose(0, 1)           # (q_len, heads, head_dim)
    return out
