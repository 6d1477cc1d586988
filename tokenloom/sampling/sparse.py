"""Edits of a few (row, token) entries of a (B, V) logits tensor, in place: the processors touch
only the tokens in a row's history or ban list, so they never pass over the whole vocabulary;
and the history layouts they read."""

from __future__ import annotations

import numpy as np
import torch


def right_aligned(rows: list[list[int]], device=None) -> torch.Tensor:
    """Ragged token lists -> (R, longest) int64, each row's tokens at its end after -1 padding (so
    the last tokens of every row share columns). Built in numpy: a list per row converts faster
    than one nested list through torch.tensor (docs/BENCHMARKS.md, 'Measurements behind design
    choices')."""
    width = max((len(r) for r in rows), default=0)
    out = np.full((len(rows), width), -1, dtype=np.int64)
    for i, r in enumerate(rows):
        if r:
            out[i, width - len(r) :] = r
    return torch.from_numpy(out).to(device)


def last_columns(ids: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """ids (R, L) right-aligned, counts (R,) -> (R, L) bool: each row's last counts[r] columns that
    hold a token (not padding)."""
    from_end = torch.arange(ids.shape[1] - 1, -1, -1, device=ids.device)  # (L,) 0 at the last
    return (from_end[None, :] < counts[:, None]) & (ids >= 0)


def take_rows(x: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """x[rows] along dim 0: x itself where rows are all of them in order, else one index_select
    (x[list] takes torch's general gather, much slower than index_select: docs/BENCHMARKS.md,
    'Measurements behind design choices').
    On a GPU the index travels pinned and asynchronously (no wait for the device's queued work)."""
    if rows == list(range(x.shape[0])):
        return x
    index = torch.tensor(rows, dtype=torch.int64)
    if x.is_cuda:
        index = index.pin_memory().to(x.device, non_blocking=True)
    return x.index_select(0, index)


def ban(logits: torch.Tensor, rows: list[int], tokens: list[int]) -> None:
    """logits[rows[i], tokens[i]] = -inf for each i, in place."""
    if rows:
        logits[rows, tokens] = float("-inf")
