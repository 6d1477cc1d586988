"""Logit processors: each takes float32 logits (B, V) and the rows' metadata and adjusts the
logits. Each edits, in place, a copy apply_processors made, and only the entries it changes
(the tokens of a row's history or ban list: sparse.py). They run for greedy rows too (each can
change the argmax), in the order of PROCESSORS: logit bias, min_tokens, bad words, n-gram
blocking, repetition/frequency/presence penalties, DRY.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import torch

from tokenloom.sampling.bans import bad_word_bans, ngram_bans
from tokenloom.sampling.dry import DryBreakers, dry_penalties
from tokenloom.sampling.metadata import SamplingMetadata
from tokenloom.sampling.sparse import ban, last_columns
from tokenloom.sampling.state import dry_enabled


def apply_logit_bias(logits: torch.Tensor, meta: SamplingMetadata) -> None:
    rows = [i for i, p in enumerate(meta.params) for _ in (p.logit_bias or {})]
    tokens = [t for p in meta.params for t in (p.logit_bias or {})]
    biases = [b for p in meta.params for b in (p.logit_bias or {}).values()]
    logits.index_put_(
        (torch.tensor(rows), torch.tensor(tokens)),
        torch.tensor(biases, dtype=logits.dtype, device=logits.device),
        accumulate=True,
    )


def apply_min_tokens(logits: torch.Tensor, meta: SamplingMetadata) -> None:
    """Forbid EOS and stop token ids until a row has min_tokens outputs."""
    rows, tokens = [], []
    for i, p in enumerate(meta.params):
        if len(meta.output_token_ids[i]) < p.min_tokens:
            banned = set(p.stop_token_ids) | (set() if p.ignore_eos else set(meta.eos_token_ids[i]))
            rows += [i] * len(banned)
            tokens += sorted(banned)
    ban(logits, rows, tokens)


def apply_bad_words(logits: torch.Tensor, meta: SamplingMetadata) -> None:
    assert meta.states is not None  # __post_init__ fills it
    ban(logits, *bad_word_bans(meta.histories(), [s.bad_words_ids for s in meta.states]))


def apply_no_repeat_ngram(logits: torch.Tensor, meta: SamplingMetadata) -> None:
    """Ban tokens completing an n-gram already in the row's prompt + output (one pass per distinct n)."""
    sizes = [p.no_repeat_ngram_size for p in meta.params]
    ids, lengths = meta.history_matrix().to(logits.device), [len(h) for h in meta.histories()]
    for n in sorted(set(sizes) - {0}):
        rows = [i for i, s in enumerate(sizes) if s == n]
        local, tokens = ngram_bans(ids[rows], [lengths[i] for i in rows], n)
        ban(logits, [rows[r] for r in local], tokens)


def _row_values(values: list, logits: torch.Tensor, dtype=None) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype or logits.dtype, device=logits.device)


def apply_penalties(logits: torch.Tensor, meta: SamplingMetadata) -> None:
    """Repetition (prompt + output), frequency and presence (output only) penalties, over each row's
    last repetition_penalty_range tokens (0: all). Touches only the tokens seen, via their
    positions in the flattened logits."""
    params, (B, V), flat = meta.params, logits.shape, logits.view(-1)
    rep = _row_values([p.repetition_penalty for p in params], logits)
    freq, pres = (
        _row_values([p.frequency_penalty for p in params], logits),
        _row_values([p.presence_penalty for p in params], logits),
    )
    ids = meta.history_matrix().to(logits.device)  # (B, L)
    window = _row_values([p.repetition_penalty_range or ids.shape[1] for p in params], logits, torch.int64)
    seen = last_columns(ids, window)  # (B, L)
    positions = torch.arange(B, device=logits.device)[:, None] * V + ids  # (B, L)
    if (rep != 1).any():
        unique = torch.unique(positions[seen])  # (U,)
        values, r = flat[unique], rep[unique // V]
        flat[unique] = torch.where(values > 0, values / r, values * r)
    if (freq != 0).any() or (pres != 0).any():
        outputs = seen & last_columns(ids, _row_values([len(o) for o in meta.output_token_ids], logits, torch.int64))
        counted, counts = torch.unique(positions[outputs], return_counts=True)
        row = counted // V
        flat[counted] -= freq[row] * counts.to(logits.dtype) + pres[row]


def apply_dry(logits: torch.Tensor, meta: SamplingMetadata) -> None:
    on = [i for i, p in enumerate(meta.params) if dry_enabled(p)]
    histories = meta.histories()
    assert meta.states is not None  # __post_init__ fills it
    breakers = cast("list[DryBreakers]", [meta.states[i].dry_breakers for i in on])  # DRY on: resolved
    positions, penalties = dry_penalties(
        meta.history_matrix()[on].to(logits.device),
        [histories[i] for i in on],
        [meta.params[i] for i in on],
        breakers,
        logits.shape[1],
    )
    rows = torch.tensor(on, device=logits.device)[positions // logits.shape[1]]  # local row -> batch row
    logits.view(-1)[rows * logits.shape[1] + positions % logits.shape[1]] -= penalties


Processor = Callable[[torch.Tensor, SamplingMetadata], None]  # edits its own copy, in place
# (name, does any row use it, the processor), in the order they run
PROCESSORS: tuple[tuple[str, Callable[[SamplingMetadata], bool], Processor], ...] = (
    ("logit_bias", lambda m: any(p.logit_bias for p in m.params), apply_logit_bias),
    ("min_tokens", lambda m: any(p.min_tokens for p in m.params), apply_min_tokens),
    ("bad_words", lambda m: any(p.bad_words for p in m.params), apply_bad_words),
    ("no_repeat_ngram", lambda m: any(p.no_repeat_ngram_size for p in m.params), apply_no_repeat_ngram),
    (
        "penalties",
        lambda m: any(p.repetition_penalty != 1 or p.frequency_penalty or p.presence_penalty for p in m.params),
        apply_penalties,
    ),
    ("dry", lambda m: any(dry_enabled(p) for p in m.params), apply_dry),
)


def apply_processors(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """All processors any row uses, in PROCESSORS' order, on one copy of `logits` (returned; `logits`
    itself when no row uses any). Never writes into `logits`."""
    used = [processor for _, in_use, processor in PROCESSORS if in_use(meta)]
    if not used:
        return logits
    out = logits.clone()
    for processor in used:
        processor(out, meta)
    return out
