"""The chain's filters: each takes float32 logits (R, V) and one setting per row, and returns the
logits with the tokens it removes set to -inf (rows whose setting is "off" come back unchanged,
and a filter every row has off costs nothing). None of them writes into its input.

Top-k and top-p live in ranked.py (they can narrow the rows to the columns that survive). Each
restates a reference: temperature and min-p as vLLM; typical_p, epsilon and
eta as HF transformers' warpers (keeping at least the most likely token); top-n-sigma and XTC's
cut as llama.cpp. The chain (chain.py) decides their order and mixes XTC's two branches.
"""

from __future__ import annotations

import math

import torch

from tokenloom.sampling import kernels

NEG_INF = float("-inf")


def rows_of(values, logits: torch.Tensor) -> torch.Tensor:
    """Per-row settings -> (R, 1) in the logits' dtype and device."""
    return torch.tensor(values, dtype=logits.dtype, device=logits.device)[:, None]


def _keep_top(remove: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """`remove` (R, V) without each row's most likely token (HF's min_tokens_to_keep=1)."""
    return remove.scatter(1, logits.argmax(-1, keepdim=True), False)


def apply_temperature(logits: torch.Tensor, temperature: list[float]) -> torch.Tensor:
    """Divide each row by its temperature (0, greedy, divides by 1: greedy rows take the argmax)."""
    temps = [t if t > 0 else 1.0 for t in temperature]
    return logits if all(t == 1.0 for t in temps) else logits / rows_of(temps, logits)


def apply_min_p(logits: torch.Tensor, min_p: list[float]) -> torch.Tensor:
    """Drop tokens whose probability is below min_p x the row's top probability (0: off)."""
    if not any(min_p):
        return logits
    probs = logits.softmax(-1)
    threshold = probs.max(-1, keepdim=True).values * rows_of(min_p, logits)
    return logits.masked_fill(probs < threshold, NEG_INF)


def apply_typical_p(logits: torch.Tensor, mass: list[float]) -> torch.Tensor:
    """Locally typical sampling (Meister et al.; HF's TypicalLogitsWarper): order tokens by how far
    their surprise is from the row's entropy, keep the closest ones until their probability
    reaches `mass` (1: off), and every token exactly as far as the last one kept."""
    if all(m >= 1 for m in mass):
        return logits
    log_p = logits.log_softmax(-1)  # (R, V)
    entropy = -(log_p * log_p.exp()).nansum(-1, keepdim=True)  # (R, 1); 0 x -inf is NaN: skipped
    distance, order = (-log_p - entropy).abs().sort(dim=-1)  # most typical first
    cumulative = logits.gather(-1, order).softmax(-1).cumsum(-1)  # (R, V)
    last = (cumulative < rows_of(mass, logits)).sum(-1, keepdim=True).clamp(max=logits.shape[-1] - 1)
    remove_sorted = distance > distance.gather(1, last)
    remove_sorted[:, 0] = False  # at least one token
    remove = remove_sorted.scatter(1, order, remove_sorted)
    remove[[i for i, m in enumerate(mass) if m >= 1]] = False
    return logits.masked_fill(remove, NEG_INF)


def top_n_sigma_threshold(logits: torch.Tensor, n: list[float]) -> torch.Tensor:
    """(R, 1): each row's largest logit less n population standard deviations of its finite logits
    (-inf where n is 0: keep all)."""
    if kernels.enabled(logits):
        stats = kernels.row_finite_stats(logits)  # (R, 4)
        std, top = stats[:, 2:3], stats[:, 3:4]
    else:
        finite = logits > NEG_INF
        count = finite.sum(-1, keepdim=True).clamp(min=1)
        values = torch.where(finite, logits, 0.0)
        mean = values.sum(-1, keepdim=True) / count
        std = ((values - mean).where(finite, 0.0).square().sum(-1, keepdim=True) / count).sqrt()
        top = logits.max(-1, keepdim=True).values
    return (top - rows_of(n, logits) * std).masked_fill(rows_of(n, logits) <= 0, NEG_INF)


def apply_top_n_sigma(logits: torch.Tensor, n: list[float]) -> torch.Tensor:
    """Keep logits within n population standard deviations of the row's largest, the mean and
    deviation taken over its finite logits (llama.cpp's top-n-sigma; 0: off). Scaling a row by a
    temperature scales both sides alike, so its place before or after temperature does not matter."""
    if not any(v > 0 for v in n):
        return logits
    return logits.masked_fill(logits < top_n_sigma_threshold(logits, n), NEG_INF)


def apply_epsilon_cutoff(logits: torch.Tensor, epsilon: list[float]) -> torch.Tensor:
    """Drop tokens whose probability is below epsilon (HF's EpsilonLogitsWarper; 0: off)."""
    if not any(epsilon):
        return logits
    remove = logits.softmax(-1) < rows_of(epsilon, logits)
    return logits.masked_fill(_keep_top(remove, logits), NEG_INF)


def apply_eta_cutoff(logits: torch.Tensor, eta: list[float]) -> torch.Tensor:
    """Drop tokens whose probability is below min(eta, sqrt(eta) x exp(-entropy)) (Hewitt et al.;
    HF's EtaLogitsWarper; 0: off)."""
    if not any(eta):
        return logits
    log_p = logits.log_softmax(-1)
    probs = log_p.exp()
    entropy = -(probs * log_p).nansum(-1, keepdim=True)  # (R, 1)
    epsilon = rows_of(eta, logits)
    threshold = torch.minimum(epsilon, epsilon.sqrt() * torch.exp(-entropy))
    remove = (probs < threshold) & (epsilon > 0)
    return logits.masked_fill(_keep_top(remove, logits), NEG_INF)


def xtc_cut(logits: torch.Tensor, threshold: list[float]) -> torch.Tensor:
    """XTC's cut (llama.cpp's "exclude top choices"): where two or more tokens have probability
    >= threshold, remove all of them but the least likely. Whether it fires is the chain's
    business (it mixes the cut and uncut distributions by xtc_probability)."""
    probs = logits.softmax(-1)
    above = probs >= rows_of(threshold, logits)  # (R, V)
    least_above = probs.masked_fill(~above, math.inf).min(-1, keepdim=True).values
    remove = above & (probs > least_above) & (above.sum(-1, keepdim=True) >= 2)
    return logits.masked_fill(remove, NEG_INF)
