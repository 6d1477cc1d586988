"""Edits of a few (row, token) entries of a (B, V) logits tensor, in place: the processors touch
only the tokens in a row's history or ban list, so they never pass over the whole vocabulary;
and the history layouts they read."""

from __future__ import annotations

import torch


def flat_positions(rows: list[list[int]], vocab: int, device) -> torch.Tensor:
    """Ragged token lists -> (N,) int64 positions row * vocab + token in a flattened (B, V) tensor."""
    lengths = torch.tensor([len(r) for r in rows], dtype=torch.int64)
    tokens = torch.tensor([t for r in rows for t in r], dtype=torch.int64)
    row_of = torch.repeat_interleave(torch.arange(len(rows), dtype=torch.int64), lengths)
    return (row_of * vocab + tokens).to(device)


def right_aligned(rows: list[list[int]], device=None) -> torch.Tensor:
    """Ragged token lists -> (R, longest) int64, each row's tokens at its end after -1 padding (so
    the last tokens of every row share columns)."""
    width = max((len(r) for r in rows), default=0)
    return torch.tensor([[-1] * (width - len(r)) + r for r in rows], dtype=torch.int64, device=device)


def ban(logits: torch.Tensor, rows: list[int], tokens: list[int]) -> None:
    """logits[rows[i], tokens[i]] = -inf for each i, in place."""
    if rows:
        logits[rows, tokens] = float("-inf")
