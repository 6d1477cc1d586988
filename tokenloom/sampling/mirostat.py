"""Mirostat (Basu et al.), as llama.cpp runs it: after temperature, a truncation that aims each
sampled token's surprise (-log2 p) at a target tau, steered by a running value mu that starts at
2 tau and after each sampled token moves by eta x (observed surprise - tau). It replaces the
other truncation filters (top-k ... eta), as in llama.cpp.

v2 keeps the tokens whose surprise is at most mu (at least the most likely one); v1 estimates
the Zipf exponent s of the top 100 probabilities and keeps the top k tokens, k chosen so that
the expected surprise is mu. Both renormalize, and the observed surprise is the chosen token's
under that renormalized distribution.
"""

from __future__ import annotations

import math

import torch

from tokenloom.sampling import kernels
from tokenloom.sampling.filters import NEG_INF

V1_TOP = 100  # llama.cpp's m: probabilities used to estimate the Zipf exponent


def _column(values, logits: torch.Tensor) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64, device=logits.device)[:, None]


def _v2_floor(logits: torch.Tensor, mu: list[float]) -> torch.Tensor:
    """(R, 1): the smallest logit v2 keeps (-log2 p > mu where x < logsumexp(x) - mu ln 2)."""
    threshold = kernels.logsumexp(logits).double() - _column(mu, logits) * math.log(2)
    return threshold.to(logits.dtype)


def mirostat_v2(logits: torch.Tensor, mu: list[float]) -> torch.Tensor:
    """logits (R, V) after temperature -> the logits of the tokens with -log2 p <= mu (at least the
    most likely one), -inf elsewhere."""
    remove = logits < _v2_floor(logits, mu)
    remove.scatter_(1, logits.argmax(-1, keepdim=True), False)
    return logits.masked_fill(remove, NEG_INF)


def mirostat_v2_columns(logits: torch.Tensor, mu: list[float]) -> tuple[torch.Tensor, torch.Tensor] | None:
    """mirostat_v2 narrowed to the most kept tokens of any row (R, W): (logits, their columns); None
    where that is a large share of the vocabulary. Tokens of probability at least 2^-mu number
    at most 2^mu, so W is small where mu is (it starts at 2 tau = 10)."""
    floor = _v2_floor(logits, mu)
    top = logits.gather(1, kernels.argmax(logits)[:, None])  # (R, 1)
    alone = floor > top  # only the most likely left
    floor = torch.where(alone, top, floor)
    width = max(int(kernels.count_at_least(logits, floor).max()), 1)
    if width * kernels.TOP_K_SHARE > logits.shape[-1]:
        return None
    values, columns = kernels.at_least(logits, floor, width)  # in column order: the
    values[:, 1:] = values[:, 1:].masked_fill(alone, NEG_INF)  # first max is the argmax
    return values, columns


def mirostat_v1(logits: torch.Tensor, mu: list[float]) -> torch.Tensor:
    """logits (R, V) after temperature -> the logits of the k most likely tokens, k from mu and the
    estimated Zipf exponent; -inf elsewhere. A zero probability among the top 100 (a row mostly
    banned) ends the estimate there rather than making it infinite."""
    V = logits.shape[1]
    top = logits.softmax(-1).double().topk(min(V1_TOP, V), dim=-1).values  # (R, m), descending
    i = torch.arange(top.shape[1] - 1, dtype=torch.float64, device=logits.device)
    t = torch.log((i + 2) / (i + 1))  # (m - 1,)
    valid = top[:, 1:] > 0
    b = torch.log(top[:, :-1] / top[:, 1:].clamp(min=1e-300)).masked_fill(~valid, 0.0)  # (R, m - 1)
    s_hat = (t * b).sum(-1, keepdim=True) / ((t * t) * valid).sum(-1, keepdim=True).clamp(min=1e-300)
    eps_hat = s_hat - 1
    k = ((eps_hat * torch.pow(2.0, _column(mu, logits))) / (1 - torch.pow(float(V), -eps_hat))) ** (1 / s_hat)
    k = torch.nan_to_num(k, nan=1.0, posinf=float(V)).clamp(1, V).long()  # (R, 1)
    kth = logits.sort(dim=-1, descending=True).values.gather(1, k - 1)
    return logits.masked_fill(logits < kth, NEG_INF)


MIROSTAT = {1: mirostat_v1, 2: mirostat_v2}


def next_mu(mu: float, chosen_prob: float, tau: float, eta: float) -> float:
    """mu after sampling a token of probability `chosen_prob` in the truncated distribution."""
    surprise = -math.log2(chosen_prob) if chosen_prob > 0 else math.inf
    return mu - eta * (surprise - tau)
