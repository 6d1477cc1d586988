"""Logit processors: each takes float32 logits (B, V) and the rows' metadata and returns adjusted
logits. They run for greedy rows too (each can change the argmax), in the order of PROCESSORS:
logit bias, min_tokens, bad words, n-gram blocking, repetition/frequency/presence penalties, DRY.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from tokenloom.sampling.bans import apply_bans, bad_word_bans, ngram_bans
from tokenloom.sampling.dry import dry_penalties
from tokenloom.sampling.metadata import SamplingMetadata
from tokenloom.sampling.state import dry_enabled


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
    logits = logits.clone()
    for i, p in enumerate(meta.params):
        for token, bias in (p.logit_bias or {}).items():
            logits[i, token] += bias
    return logits


def apply_min_tokens(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Forbid EOS and stop token ids until a row has min_tokens outputs."""
    bans = []
    for i, p in enumerate(meta.params):
        if len(meta.output_token_ids[i]) < p.min_tokens:
            banned = set(p.stop_token_ids) | (set() if p.ignore_eos else set(meta.eos_token_ids[i]))
            bans += [(i, t) for t in sorted(banned)]
    return apply_bans(logits, bans)


def apply_bad_words(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    return apply_bans(logits, bad_word_bans(meta.histories(), [s.bad_words_ids for s in meta.states]))


def apply_no_repeat_ngram(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Ban tokens completing an n-gram already in the row's prompt + output (one pass per distinct n)."""
    sizes = [p.no_repeat_ngram_size for p in meta.params]
    histories = meta.histories()
    logits = logits.clone()
    for n in sorted(set(sizes) - {0}):
        rows = [i for i, s in enumerate(sizes) if s == n]
        banned = ngram_bans([histories[i] for i in rows], n, logits.shape[1], logits.device)   # (R, V)
        logits[rows] = logits[rows].masked_fill(banned, float("-inf"))
    return logits


def _windows(meta: SamplingMetadata) -> tuple[list[list[int]], list[list[int]]]:
    """Per row: the tokens the penalties see (the last repetition_penalty_range of prompt + output,
    0: all) and the output tokens among them."""
    seen, outputs = [], []
    for p, history, output in zip(meta.params, meta.histories(), meta.output_token_ids):
        n = p.repetition_penalty_range
        seen.append(history[-n:] if n else history)
        outputs.append(output[-n:] if n else output)
    return seen, outputs


def apply_penalties(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Repetition (prompt + output), frequency and presence (output only) penalties, over each row's
    last repetition_penalty_range tokens (0: all)."""
    params = meta.params
    V = logits.shape[1]
    rep = torch.tensor([p.repetition_penalty for p in params], device=logits.device)[:, None]
    freq = torch.tensor([p.frequency_penalty for p in params], device=logits.device)[:, None]
    pres = torch.tensor([p.presence_penalty for p in params], device=logits.device)[:, None]
    seen_ids, output_ids = _windows(meta)
    out_counts = token_counts(output_ids, V, logits.device)              # (B, V)
    if (rep != 1).any():
        seen = token_counts(seen_ids, V, logits.device) > 0
        penalized = torch.where(logits > 0, logits / rep, logits * rep)
        logits = torch.where(seen, penalized, logits)
    if (freq != 0).any() or (pres != 0).any():
        logits = logits - freq * out_counts - pres * (out_counts > 0).float()
    return logits


def apply_dry(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    on = [i for i, p in enumerate(meta.params) if dry_enabled(p)]
    histories = meta.histories()
    penalty = dry_penalties([histories[i] for i in on], [meta.params[i] for i in on],
                            [meta.states[i].dry_breakers for i in on], logits.shape[1], logits.device)
    out = logits.clone()
    out[on] -= penalty
    return out


Processor = Callable[[torch.Tensor, SamplingMetadata], torch.Tensor]
# (name, does any row use it, the processor), in the order they run
PROCESSORS: tuple[tuple[str, Callable[[SamplingMetadata], bool], Processor], ...] = (
    ("logit_bias", lambda m: any(p.logit_bias for p in m.params), apply_logit_bias),
    ("min_tokens", lambda m: any(p.min_tokens for p in m.params), apply_min_tokens),
    ("bad_words", lambda m: any(p.bad_words for p in m.params), apply_bad_words),
    ("no_repeat_ngram", lambda m: any(p.no_repeat_ngram_size for p in m.params), apply_no_repeat_ngram),
    ("penalties", lambda m: any(p.repetition_penalty != 1 or p.frequency_penalty or p.presence_penalty
                                for p in m.params), apply_penalties),
    ("dry", lambda m: any(dry_enabled(p) for p in m.params), apply_dry),
)


def apply_processors(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """All processors any row uses, in PROCESSORS' order. Never writes into `logits`."""
    for _, used, processor in PROCESSORS:
        if used(meta):
            logits = processor(logits, meta)
    return logits
