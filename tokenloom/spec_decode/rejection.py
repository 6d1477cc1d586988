"""The acceptance rules that make speculative decoding lossless. Pure functions of tensors.

Notation for one request with k draft tokens d_0..d_{k-1}:
  p_j  target distribution at draft position j (what the target would sample from
       after the tokens so far plus d_0..d_{j-1}); p_k follows all k drafts;
  q_j  the distribution the proposer drew d_j from (one-hot for a deterministic
       proposer such as n-gram lookup).
Both are the *processed* distributions (temperature, top-k/p, min-p, penalties),
so the tokens produced are distributed exactly as plain sampling from p.
"""

from __future__ import annotations

import torch


def accept_greedy(target_argmax: list[int], draft_tokens: list[int]) -> list[int]:
    """Greedy verification: keep the longest prefix of drafts equal to the target's argmax,
    then the target's own token at the first disagreement (or after the last draft).

    target_argmax has k + 1 entries (one per draft position, plus the one after all drafts).
    Returns 1..k+1 tokens: exactly what greedy decoding without drafts would produce.
    """
    out = []
    for j, d in enumerate(draft_tokens):
        if d != target_argmax[j]:
            break
        out.append(d)
    out.append(target_argmax[len(out)])
    return out


def accept_sampled(
    target_probs: torch.Tensor,
    draft_tokens: list[int],
    draft_probs: torch.Tensor | None,
    generator: torch.Generator | None = None,
) -> list[int]:
    """Rejection sampling of Leviathan et al. (2023), Algorithm 1.

    target_probs: (k + 1, V) p_0..p_k; draft_probs: (k, V) q_0..q_{k-1}, or None when each
    d_j was proposed deterministically (q_j = one-hot(d_j)). Returns 1..k+1 tokens whose
    joint distribution equals sampling them one by one from the target.

    For j = 0, 1, ...:
      accept d_j with probability min(1, p_j(d_j) / q_j(d_j));
      on rejection, emit one token drawn from norm(max(0, p_j - q_j)) and stop.
    If all k drafts are accepted, emit a bonus token drawn from p_k.
    (P(emit x at j) = q(x) min(1, p(x)/q(x)) + P(reject) * residual(x) = min(q, p)(x)
    + max(0, p - q)(x) = p(x), which is why the output is exactly target-distributed.)
    """
    out: list[int] = []
    for j, d in enumerate(draft_tokens):
        p = target_probs[j]
        q_d = 1.0 if draft_probs is None else float(draft_probs[j, d])
        u = float(torch.rand((), generator=generator))
        if q_d > 0 and u < float(p[d]) / q_d:  # accept with prob min(1, p/q)
            out.append(d)
            continue
        if draft_probs is None:
            residual = p.clone()
            residual[d] = 0  # max(0, p - one_hot(d))
        else:
            residual = (p - draft_probs[j]).clamp_min(0)
        if float(residual.sum()) <= 0:  # p <= q everywhere yet rejected: only by rounding; fall back to p
            residual = p
        out.append(int(torch.multinomial(residual / residual.sum(), 1, generator=generator)))
        return out
    out.append(int(torch.multinomial(target_probs[len(draft_tokens)], 1, generator=generator)))  # bonus
    return out
