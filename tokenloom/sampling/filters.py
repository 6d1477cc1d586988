"""The chain's filters: each takes float32 logits (R, V) and one setting per row, and returns the
logits with the tokens it removes set to -inf (rows whose setting is "off" come back unchanged,
and a filter every row has off costs nothing). None of them writes into its input.

Each restates a reference: temperature, top-k, top-p and min-p as vLLM; typical_p, epsilon and
eta as HF transformers' warpers (keeping at least the most likely token); top-n-sigma and XTC's
cut as llama.cpp. The chain (chain.py) decides their order and mixes XTC's two branches.
"""

from __future__ import annotations

import math

import torch

NEG_INF = float("-inf")


def _rows(values, logits: torch.Tensor) -> torch.Tensor:
    """Per-row settings -> (R, 1) in the logits' dtype and device."""
    return torch.tensor(values, dtype=logits.dtype, device=logits.device)[:, None]


def _keep_top(remove: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """`remove` (R, V) without each row's most likely token (HF's min_tokens_to_keep=1)."""
    return remove.scatter(1, logits.argmax(-1, keepdim=True), False)


def apply_temperature(logits: torch.Tensor, temperature: list[float]) -> torch.Tensor:
    """Divide each row by its temperature (0, greedy, divides by 1: greedy rows take the argmax)."""
    temps = [t if t > 0 else 1.0 for t in temperature]
    return logits if all(t == 1.0 for t in temps) else logits / _rows(temps, logits)


def apply_top_k(logits: torch.Tensor, top_k: list[int]) -> torch.Tensor:
    """Keep each row's k largest logits (k = 0: keep all)."""
    if not any(top_k):
        return logits
    V = logits.shape[-1]
    k = torch.tensor([min(t, V) if t > 0 else V for t in top_k], device=logits.device)
    sorted_desc = logits.sort(dim=-1, descending=True).values
    kth = sorted_desc.gather(1, (k - 1)[:, None])                 # (R, 1)
    return logits.masked_fill(logits < kth, NEG_INF)


def apply_top_p(logits: torch.Tensor, top_p: list[float]) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose probability reaches top_p (1: off)."""
    if all(p >= 1 for p in top_p):
        return logits
    probs_sorted, idx = logits.softmax(-1).sort(dim=-1, descending=True)
    before = probs_sorted.cumsum(-1) - probs_sorted               # mass strictly above each token
    drop_sorted = before >= _rows(top_p, logits)                  # the top token always has before=0
    drop = torch.zeros_like(drop_sorted).scatter(1, idx, drop_sorted)
    return logits.masked_fill(drop, NEG_INF)


def apply_min_p(logits: torch.Tensor, min_p: list[float]) -> torch.Tensor:
    """Drop tokens whose probability is below min_p x the row's top probability (0: off)."""
    if not any(min_p):
        return logits
    probs = logits.softmax(-1)
    threshold = probs.max(-1, keepdim=True).values * _rows(min_p, logits)
    return logits.masked_fill(probs < threshold, NEG_INF)


def apply_typical_p(logits: torch.Tensor, mass: list[float]) -> torch.Tensor:
    """Locally typical sampling (Meister et al.; HF's TypicalLogitsWarper): order tokens by how far
    their surprise is from the row's entropy, keep the closest ones until their probability
    reaches `mass` (1: off), and every token exactly as far as the last one kept."""
    if all(m >= 1 for m in mass):
        return logits
    log_p = logits.log_softmax(-1)                                       # (R, V)
    entropy = -(log_p * log_p.exp()).nansum(-1, keepdim=True)            # (R, 1); 0 x -inf is NaN: skipped
    distance, order = (-log_p - entropy).abs().sort(dim=-1)              # most typical first
    cumulative = logits.gather(-1, order).softmax(-1).cumsum(-1)         # (R, V)
    last = (cumulative < _rows(mass, logits)).sum(-1, keepdim=True).clamp(max=logits.shape[-1] - 1)
    remove_sorted = distance > distance.gather(1, last)
    remove_sorted[:, 0] = False                                          # at least one token
    remove = remove_sorted.scatter(1, order, remove_sorted)
    remove[[i for i, m in enumerate(mass) if m >= 1]] = False
    return logits.masked_fill(remove, NEG_INF)


def apply_top_n_sigma(logits: torch.Tensor, n: list[float]) -> torch.Tensor:
    """Keep logits within n population standard deviations of the row's largest, the mean and
    deviation taken over its finite logits (llama.cpp's top-n-sigma; 0: off). Scaling a row by a
    temperature scales both sides alike, so its place before or after temperature does not matter."""
    if not any(v > 0 for v in n):
        return logits
    finite = torch.isfinite(logits)
    count = finite.sum(-1, keepdim=True).clamp(min=1)
    values = logits.masked_fill(~finite, 0.0)
    mean = values.sum(-1, keepdim=True) / count
    std = (((values - mean) ** 2) * finite).sum(-1, keepdim=True).div(count).sqrt()      # (R, 1)
    threshold = logits.max(-1, keepdim=True).values - _rows(n, logits) * std
    remove = (logits < threshold) & (_rows(n, logits) > 0)
    return logits.masked_fill(remove, NEG_INF)


def apply_epsilon_cutoff(logits: torch.Tensor, epsilon: list[float]) -> torch.Tensor:
    """Drop tokens whose probability is below epsilon (HF's EpsilonLogitsWarper; 0: off)."""
    if not any(epsilon):
        return logits
    remove = logits.softmax(-1) < _rows(epsilon, logits)
    return logits.masked_fill(_keep_top(remove, logits), NEG_INF)


def apply_eta_cutoff(logits: torch.Tensor, eta: list[float]) -> torch.Tensor:
    """Drop tokens whose probability is below min(eta, sqrt(eta) x exp(-entropy)) (Hewitt et al.;
    HF's EtaLogitsWarper; 0: off)."""
    if not any(eta):
        return logits
    log_p = logits.log_softmax(-1)
    probs = log_p.exp()
    entropy = -(probs * log_p).nansum(-1, keepdim=True)                  # (R, 1)
    epsilon = _rows(eta, logits)
    threshold = torch.minimum(epsilon, epsilon.sqrt() * torch.exp(-entropy))
    remove = (probs < threshold) & (epsilon > 0)
    return logits.masked_fill(_keep_top(remove, logits), NEG_INF)


def xtc_cut(logits: torch.Tensor, threshold: list[float]) -> torch.Tensor:
    """XTC's cut (llama.cpp's "exclude top choices"): where two or more tokens have probability
    >= threshold, remove all of them but the least likely. Whether it fires is the chain's
    business (it mixes the cut and uncut distributions by xtc_probability)."""
    probs = logits.softmax(-1)
    above = probs >= _rows(threshold, logits)                            # (R, V)
    least_above = probs.masked_fill(~above, math.inf).min(-1, keepdim=True).values
    remove = above & (probs > least_above) & (above.sum(-1, keepdim=True) >= 2)
    return logits.masked_fill(remove, NEG_INF)
