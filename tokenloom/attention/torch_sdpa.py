"""Paged attention in torch ops on scaled_dot_product_attention: any device, any dtype, the
reference the kernels are checked against. Which rows the CPU kernels take instead is decided
in backend.py, not here.

Prompt chunks run one SDPA call per sequence. A pure-decode batch runs as one padded call: one
gather of every sequence's blocks and a mask that hides each sequence's padding, so a sequence
still attends to exactly its own context whatever its batch companions are (the padded slots are
read, masked: ``backend.reads_past_context``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tokenloom.attention.metadata import AttentionMetadata
from tokenloom.kv_cache.quantized import QUANTIZED_CACHES, write_cache


def write_kv(k_cache, v_cache, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Scatter this step's keys/values (T, kv_heads, head_dim) into their cache slots (in place).

    A cache is a tensor of the compute dtype or a quantized one (kv_cache/quantized.py: quantized on write,
    dequantized by indexing, so the readers below are the same for both).
    """
    write_cache(k_cache, k, slot_mapping)
    write_cache(v_cache, v, slot_mapping)


def select_blocks(cache, table: torch.Tensor) -> torch.Tensor:
    """cache[table] for a block table of any shape -> (*table.shape, block_size, kv_heads, head_dim).

    index_select on the flat table: faster than advanced indexing on CPU (docs/BENCHMARKS.md,
    'Measurements behind design choices'). A table on the host is moved to the cache's device first.
    """
    table = table.to(cache.data.device if isinstance(cache, QUANTIZED_CACHES) else cache.device)
    if isinstance(cache, QUANTIZED_CACHES):
        return cache[table]
    return cache.index_select(0, table.reshape(-1)).view(*table.shape, *cache.shape[1:])


def _gather(cache, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """The first `length` cached tokens of a sequence: (kv_heads, length, head_dim)."""
    _, _, kv_heads, head_dim = cache.shape
    blocks = select_blocks(cache, block_table)  # (nb, block_size, kv_heads, head_dim)
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


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
    out: torch.Tensor | None = None,
    skip: frozenset[int] = frozenset(),
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of this step's queries against each sequence's cached context (its
    last `window` positions; None: all), scores soft-capped where `softcap` is given, each head's
    sink logit counted in its softmax where `sinks` (heads,) is given, in torch ops only. Does not
    write the cache: the caller has written this step's k/v (``write_kv``).

    q: (T, heads, head_dim); k, v: (T, kv_heads, head_dim); caches:
    (num_blocks, block_size, kv_heads, head_dim). Returns `out` (T, heads, head_dim; new if
    None) with the rows of every sequence but those in `skip` (whose rows another kernel fills).
    """
    gqa = q.shape[1] != k.shape[1]
    if not skip and meta.num_seqs > 1 and max(meta.query_lens) == 1 and softcap is None and sinks is None:
        return _decode_batch(q, k_cache, v_cache, meta, scale, gqa, window)
    out = torch.empty_like(q) if out is None else out
    for i, (start, q_len, ctx_len, table) in enumerate(
        zip(meta.query_start, meta.query_lens, meta.context_lens, meta.block_tables)
    ):
        if i in skip:
            continue
        rows = slice(start, start + q_len)
        if softcap is not None:
            out[rows] = _softcapped_sequence(q[rows], k_cache, v_cache, table, ctx_len, scale, window, softcap)
        else:
            out[rows] = _sdpa_sequence(
                q[rows], k[rows], v[rows], k_cache, v_cache, table, ctx_len, scale, window, sinks
            )
    return out


def _sdpa_sequence(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache,
    v_cache,
    table: torch.Tensor,
    ctx_len: int,
    scale: float,
    window: int | None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """One sequence's chunk through torch SDPA: q (q_len, heads, head_dim), k/v its new keys and
    values (q_len, kv_heads, head_dim), already in the cache -> (q_len, heads, head_dim); with
    `sinks` (heads,), each head's softmax counts exp(sink) too (``_with_sinks``)."""
    q_len = q.shape[0]
    qi = q.transpose(0, 1)[None]  # (1, heads, q_len, head_dim)
    # A quantized cache is always read back, so a prompt attends to the same (quantized) keys
    # whether it is prefilled whole, in chunks, or found in the prefix cache.
    if q_len == ctx_len and not isinstance(k_cache, QUANTIZED_CACHES):  # the whole context is this step's
        ki, vi = k.transpose(0, 1), v.transpose(0, 1)  # (kv_heads, q_len, head_dim)
    else:
        ki = _gather(k_cache, table, ctx_len)  # (kv_heads, ctx_len, head_dim)
        vi = _gather(v_cache, table, ctx_len)
    causal_only = q_len == ctx_len and q_len > 1 and (window is None or ctx_len <= window)
    mask = None if causal_only else _mask(q_len, ctx_len, window, q.device)
    if sinks is not None:
        return _with_sinks(qi[0], ki, vi, mask, causal_only, scale, sinks).transpose(0, 1)
    out = F.scaled_dot_product_attention(
        qi, ki[None], vi[None], attn_mask=mask, is_causal=causal_only, scale=scale, enable_gqa=q.shape[1] != k.shape[1]
    )
    return out[0].transpose(0, 1)  # (q_len, heads, head_dim)


def _with_sinks(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    causal: bool,
    scale: float,
    sinks: torch.Tensor,
) -> torch.Tensor:
    """Attention whose softmax also counts exp(sink) per head, a score with no value behind it:
    out = softmax_nosink(s) v * Z / (Z + exp(sink)) = that times sigmoid(logsumexp(s) - sink).
    q (heads, q_len, head_dim), k/v (kv_heads, ctx, head_dim) -> (heads, q_len, head_dim). On the
    CPU torch's flash kernel gives the log-sum-exp with the output; elsewhere the scores are made."""
    group = q.shape[0] // k.shape[0]
    if group > 1:
        k, v = k.repeat_interleave(group, dim=0), v.repeat_interleave(group, dim=0)
    if q.device.type == "cpu":
        bias = None if mask is None else torch.zeros(mask.shape, dtype=q.dtype).masked_fill_(~mask, float("-inf"))
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q[None], k[None], v[None], 0.0, causal, attn_mask=bias, scale=scale
        )  # (1, heads, q_len, head_dim), (1, heads, q_len)
        out, lse = out[0], lse[0]
    else:
        scores = torch.matmul(q, k.transpose(1, 2)).float() * scale  # (heads, q_len, ctx)
        if causal:
            mask = _mask(q.shape[1], k.shape[1], None, q.device)
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        lse = torch.logsumexp(scores, dim=-1)
        out = torch.matmul(torch.softmax(scores, dim=-1).to(q.dtype), v)
    share = torch.sigmoid(lse.float() - sinks.float()[:, None])  # (heads, q_len) kept of each row
    return out * share[..., None].to(out.dtype)


def _decode_inputs(
    meta: AttentionMetadata, block_size: int, device: torch.device, window: int | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Padded block tables (B, W) and the may-attend mask (B, 1, 1, W * block_size) of a decode batch,
    built at the first layer that asks and kept on `meta` (per window) for the step's other layers."""
    if meta.padded_decode_inputs is None:
        meta.padded_decode_inputs = {}
    if window in meta.padded_decode_inputs:
        return meta.padded_decode_inputs[window]
    tables = meta.padded_block_tables(list(range(meta.num_seqs))).to(device)  # padded with the null block (zeros)
    width = tables.shape[1]
    ctx = torch.tensor(meta.context_lens, device=device)[:, None]  # (B, 1)
    pos = torch.arange(width * block_size, device=device)[None, :]  # (1, L)
    allowed = pos < ctx
    if window is not None:
        allowed &= pos >= ctx - window
    meta.padded_decode_inputs[window] = tables, allowed[:, None, None, :]
    return meta.padded_decode_inputs[window]


def _decode_batch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    gqa: bool,
    window: int | None = None,
) -> torch.Tensor:
    """One query per sequence: q (B, heads, head_dim) -> (B, heads, head_dim)."""
    B = q.shape[0]
    _, block_size, kv_heads, head_dim = k_cache.shape
    tables, allowed = _decode_inputs(meta, block_size, q.device, window)
    L = tables.shape[1] * block_size
    # Slots past a sequence's end are zero (the null block, or zeroed at the block's first
    # write), so masked positions cannot inject NaN through 0-weight x value.
    keys = select_blocks(k_cache, tables).view(B, L, kv_heads, head_dim).transpose(1, 2)  # (B, kv_heads, L, hd)
    values = select_blocks(v_cache, tables).view(B, L, kv_heads, head_dim).transpose(1, 2)
    out = F.scaled_dot_product_attention(
        q[:, :, None, :], keys, values, attn_mask=allowed, scale=scale, enable_gqa=gqa
    )  # (B, heads, 1, head_dim)
    return out[:, :, 0, :]


def _softcapped_sequence(
    q: torch.Tensor,
    k_cache,
    v_cache,
    table: torch.Tensor,
    ctx_len: int,
    scale: float,
    window: int | None,
    softcap: float,
) -> torch.Tensor:
    """Gemma 2's attention for one sequence's chunk where no kernel runs, in transformers' eager
    order: scores = q k^T * scale, tanh(scores / softcap) * softcap, masked, softmax in float32,
    times v. q: (q_len, heads, head_dim) -> (q_len, heads, head_dim)."""
    q_len, group = q.shape[0], q.shape[1] // k_cache.shape[2]
    qi = q.transpose(0, 1)  # (heads, q_len, head_dim)
    ki = _gather(k_cache, table, ctx_len).repeat_interleave(group, dim=0)  # (heads, ctx_len, head_dim)
    vi = _gather(v_cache, table, ctx_len).repeat_interleave(group, dim=0)
    scores = torch.matmul(qi, ki.transpose(1, 2)) * scale  # (heads, q_len, ctx_len)
    scores = torch.tanh(scores / softcap) * softcap
    mask = _mask(q_len, ctx_len, window, q.device)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(weights, vi).transpose(0, 1)


def latent_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    k_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    value_dim: int,
    window: int | None = None,
    skip: frozenset[int] = frozenset(),
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Latent attention (DeepSeek's MLA, absorbed): one cached key a token, shared by every head,
    whose last `value_dim` dims are its value. q (T, heads, D), k (T, 1, D) this step's keys
    (already written: ``write_cache``), k_cache (num_blocks, block_size, 1, D) -> `out`
    (T, heads, value_dim; new if None) with the rows of every sequence but those in `skip`.
    Scores q k^T * scale, causal (and windowed where `window`), softmax in float32. A pure-decode
    batch is one padded call; otherwise one call per sequence."""
    T, heads, _ = q.shape
    if not skip and meta.num_seqs > 1 and max(meta.query_lens) == 1:
        return _latent_decode_batch(q, k_cache, meta, scale, value_dim, window)
    out = q.new_empty(T, heads, value_dim) if out is None else out
    for i, (start, q_len, ctx_len, table) in enumerate(
        zip(meta.query_start, meta.query_lens, meta.context_lens, meta.block_tables)
    ):
        if i in skip:
            continue
        rows = slice(start, start + q_len)
        keys = k[rows, 0] if q_len == ctx_len else _gather(k_cache, table, ctx_len)[0]  # (ctx, D)
        out[rows] = _latent_sequence(q[rows], keys, scale, value_dim, _mask(q_len, ctx_len, window, q.device))
    return out


def _latent_sequence(
    q: torch.Tensor, keys: torch.Tensor, scale: float, value_dim: int, mask: torch.Tensor | None
) -> torch.Tensor:
    """q (q_len, heads, D) against one sequence's keys (ctx, D) -> (q_len, heads, value_dim); every
    head and position is a row of one matmul, the keys being shared; mask (q_len, ctx) or None."""
    q_len, heads, dim = q.shape
    scores = torch.matmul(q.reshape(q_len * heads, dim), keys.t()).view(q_len, heads, -1) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask[:, None, :], float("-inf"))
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)  # (q_len, heads, ctx)
    return torch.matmul(weights, keys[:, dim - value_dim :])  # (q_len, heads, value_dim)


def _latent_decode_batch(
    q: torch.Tensor, k_cache: torch.Tensor, meta: AttentionMetadata, scale: float, value_dim: int, window: int | None
) -> torch.Tensor:
    """One query per sequence: q (B, heads, D) -> (B, heads, value_dim), each sequence against its
    padded blocks (padding masked; its slots zero, ``backend.reads_past_context``)."""
    B, _, dim = q.shape
    block_size = k_cache.shape[1]
    tables, allowed = _decode_inputs(meta, block_size, q.device, window)  # (B, W), (B, 1, 1, L)
    keys = select_blocks(k_cache, tables).view(B, -1, dim)  # (B, L, D)
    scores = torch.bmm(q, keys.transpose(1, 2)) * scale  # (B, heads, L)
    scores = scores.masked_fill(~allowed[:, 0], float("-inf"))
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.bmm(weights, keys[..., dim - value_dim :])  # (B, heads, value_dim)
