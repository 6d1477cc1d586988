"""Logit processors: each takes float32 logits (B, V) and returns adjusted logits.

They run before greedy selection too, since each can change the argmax.
"""

from __future__ import annotations

import torch

from tokenloom.sampling.metadata import SamplingMetadata


def _id_matrix(rows: list[list[int]], vocab: int, device) -> torch.Tensor:
    """Ragged id lists -> (B, max_len) int64 padded with `vocab` (an out-of-vocab sink column)."""
    width = max((len(r) for r in rows), default=0)
    out = torch.full((len(rows), max(width, 1)), vocab, dtype=torch.int64)
    for i, r in enumerate(rows):
        if r:
            out[i, :len(r)] = torch.tensor(r, dtype=torch.int64)
    return out.to(device)


def token_counts(rows: list[list[int]], vocab: int, device) -> torch.Tensor:
    """(B, V) float32: how often each token occurs in each row's id list."""
    ids = _id_matrix(rows, vocab, device)
    counts = torch.zeros(len(rows), vocab + 1, device=device)
    counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=counts.dtype))
    return counts[:, :vocab]


def apply_logit_bias(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    for i, p in enumerate(meta.params):
        for token, bias in (p.logit_bias or {}).items():
            logits[i, token] += bias
    return logits


def apply_min_tokens(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Forbid EOS and stop token ids until a row has min_tokens outputs."""
    for i, p in enumerate(meta.params):
        if len(meta.output_token_ids[i]) < p.min_tokens:
            banned = set(p.stop_token_ids) | (set() if p.ignore_eos else set(meta.eos_token_ids[i]))
            if banned:
                logits[i, list(banned)] = float("-inf")
    return logits


def apply_penalties(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Repetition (prompt + output), frequency and presence (output only) penalties."""
    params = meta.params
    V = logits.shape[1]
    rep = torch.tensor([p.repetition_penalty for p in params], device=logits.device)[:, None]
    freq = torch.tensor([p.frequency_penalty for p in params], device=logits.device)[:, None]
    pres = torch.tensor([p.presence_penalty for p in params], device=logits.device)[:, None]
    out_counts = token_counts(meta.output_token_ids, V, logits.device)   # (B, V)
    if (rep != 1).any():
        seen = (token_counts(meta.prompt_token_ids, V, logits.device) + out_counts) > 0
        penalized = torch.where(logits > 0, logits / rep, logits * rep)
        logits = torch.where(seen, penalized, logits)
    if (freq != 0).any() or (pres != 0).any():
        logits = logits - freq * out_counts - pres * (out_counts > 0).float()
    return logits


def needs_penalties(meta: SamplingMetadata) -> bool:
    return any(p.repetition_penalty != 1 or p.frequency_penalty or p.presence_penalty for p in meta.params)


def apply_processors(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """All processors, in a fixed order: logit bias, min_tokens, penalties. Never mutates `logits`."""
    bias, min_tokens = any(p.logit_bias for p in meta.params), any(p.min_tokens for p in meta.params)
    if bias or min_tokens:
        logits = logits.clone()          # the two in-place processors write into a copy
    if bias:
        logits = apply_logit_bias(logits, meta)
    if min_tokens:
        logits = apply_min_tokens(logits, meta)
    if needs_penalties(meta):
        logits = apply_penalties(logits, meta)
    return logits
