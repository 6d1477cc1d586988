"""Top-k and top-p: filters that keep a row's most likely tokens. Both find them without sorting
the vocabulary where they can (a selection of the widest k, kernels.top_k, costs a small fraction of
a full sort: docs/BENCHMARKS.md, 'Measurements behind design choices'), and both can narrow the
rows to the columns that survive, so the rest of the chain works on those only (``*_columns``:
(logits (R, W), their columns (R, W)) or None).
"""

from __future__ import annotations

import torch

from tokenloom.sampling import kernels
from tokenloom.sampling.filters import NEG_INF, rows_of

NUCLEUS_LOOKS = (256, 2048)  # top-p looks at this many most likely tokens first, then this many, then all


def _kth_largest(logits: torch.Tensor, top_k: list[int]) -> torch.Tensor:
    """(R, 1): each row's k-th largest logit (-inf where k is 0: keep all), from one topk of the widest k."""
    V = logits.shape[-1]
    k = torch.tensor([min(t, V) if t > 0 else 0 for t in top_k], device=logits.device)
    top = kernels.top_k(logits, int(k.max()))[0]  # (R, max k), descending
    kth = top.gather(1, (k - 1).clamp(min=0)[:, None])
    return kth.masked_fill((k == 0)[:, None], NEG_INF)


def apply_top_k(logits: torch.Tensor, top_k: list[int]) -> torch.Tensor:
    """Keep each row's k largest logits, and any equal to the k-th (k = 0: keep all)."""
    if not any(top_k):
        return logits
    return logits.masked_fill(logits < _kth_largest(logits, top_k), NEG_INF)


def top_k_columns(logits: torch.Tensor, top_k: list[int]) -> tuple[torch.Tensor, torch.Tensor] | None:
    """apply_top_k narrowed to the widest k's columns (R, W), -inf past each row's own k; None where a
    row keeps everything or has a tie at its k-th logit beyond them (then apply_top_k on all columns).
    One selection of W + 1: a tie lies beyond the W columns exactly when the (W + 1)-th equals the k-th."""
    W = max(top_k)
    if not all(t > 0 for t in top_k) or logits.shape[-1] <= W:
        return None
    values, columns = kernels.top_k(logits, W + 1)  # (R, W + 1) descending
    kth = values.gather(1, torch.tensor(top_k, device=logits.device)[:, None] - 1)  # -inf: fewer than k finite
    if bool(((values[:, W:] == kth) & (kth > NEG_INF)).any()):
        return None
    values, columns = values[:, :W], columns[:, :W]
    return values.masked_fill(values < kth, NEG_INF), columns


def _nucleus_in_top(probs: torch.Tensor, top_p: torch.Tensor, width: int):
    """probs (R, V) -> (the columns (R, W) of each row's `width` most likely tokens, descending;
    whether its nucleus ends among them (R,); which of them to drop (R, W))."""
    top, columns = kernels.top_k(probs, min(width, probs.shape[-1]))
    before = top.cumsum(-1) - top  # mass strictly above each token
    resolved = (before[:, -1:] + top[:, -1:] >= top_p)[:, 0] | (top.shape[1] == probs.shape[-1])
    drop = before >= top_p
    drop[:, 0] = False  # the most likely token always stays (a top_p below float32's range reads as 0)
    return columns, resolved, drop


def apply_top_p(logits: torch.Tensor, top_p: list[float]) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose probability reaches top_p (1: off). A row
    is sorted in full only when its nucleus is wider than the last of NUCLEUS_LOOKS."""
    if all(p >= 1 for p in top_p):
        return logits
    probs, p = logits.softmax(-1), rows_of(top_p, logits)
    drop = torch.zeros_like(logits, dtype=torch.bool)
    todo = [i for i, v in enumerate(top_p) if v < 1]
    for width in (*NUCLEUS_LOOKS, logits.shape[-1]):
        columns, resolved, drop_top = _nucleus_in_top(probs[todo], p[todo], width)
        done = resolved.nonzero().flatten().tolist()
        drop[[todo[i] for i in done]] = torch.ones_like(drop[: len(done)]).scatter(1, columns[done], drop_top[done])
        todo = [todo[i] for i in (~resolved).nonzero().flatten().tolist()]
        if not todo:
            break
    return logits.masked_fill(drop, NEG_INF)


def top_p_columns(logits: torch.Tensor, top_p: list[float]) -> tuple[torch.Tensor, torch.Tensor] | None:
    """apply_top_p narrowed to the narrowest of NUCLEUS_LOOKS that holds every row's nucleus; None
    when a row is off or none does."""
    if any(p >= 1 for p in top_p) or logits.shape[-1] <= NUCLEUS_LOOKS[0]:
        return None
    probs, p = logits.softmax(-1), rows_of(top_p, logits)
    for width in NUCLEUS_LOOKS:
        columns, resolved, drop = _nucleus_in_top(probs, p, width)
        if bool(resolved.all()):
            return logits.gather(1, columns).masked_fill(drop, NEG_INF), columns
    return None
