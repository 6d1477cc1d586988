"""StepRecords from the sampler's tensors: the same filters the sampler applies, one row at a time.

Only rows whose request asked (``SamplingParams.explain``) pay for this.
"""

from __future__ import annotations

import torch

from tokenloom.explain.records import CUT_REASONS, Candidate, StepRecord
from tokenloom.sampling.filters import apply_min_p, apply_top_k, apply_top_p
from tokenloom.sampling_params import SamplingParams


def _cut_stages(params: SamplingParams):
    """The sampler's filters for one row, in its order, as (reason, logits (1, V) -> logits)."""
    return (("top_k", lambda x: apply_top_k(x, [params.top_k])),
            ("top_p", lambda x: apply_top_p(x, [params.top_p])),
            ("min_p", lambda x: apply_min_p(x, [params.min_p])))


def explain_row(raw: torch.Tensor, processed: torch.Tensor, constrained: torch.Tensor, chosen: int,
                params: SamplingParams, top_n: int) -> StepRecord:
    """One row's record. raw / processed / constrained: its logits (V,) float32 as the model gave
    them, after the processors, and after the grammar mask; `chosen`: the token the sampler
    picked. Lists the top `top_n` candidates by adjusted probability, then `chosen` if not among them."""
    finite = torch.isfinite
    reason = torch.zeros(raw.shape[0], dtype=torch.int8)                   # (V,) 0: kept, i: CUT_REASONS[i - 1]

    def mark(removed: torch.Tensor, name: str) -> None:
        reason[removed & (reason == 0)] = CUT_REASONS.index(name) + 1
    mark(~finite(processed) & finite(raw), "banned")
    mark(~finite(constrained) & finite(processed), "grammar")
    scaled = constrained / (params.temperature if params.temperature > 0 else 1.0)   # (V,)
    final = scaled[None]                                                   # (1, V)
    if not params.greedy:
        for name, stage in _cut_stages(params):
            after = stage(final)
            mark((~finite(after) & finite(final))[0], name)
            final = after
    adjusted, model, probs = scaled.softmax(-1), raw.softmax(-1), final[0].softmax(-1)
    counts = torch.bincount(reason.long(), minlength=len(CUT_REASONS) + 1).tolist()
    ids = adjusted.topk(min(top_n, adjusted.shape[0])).indices.tolist()
    if chosen not in ids:
        ids.append(chosen)
    moved = processed - raw                                                # (V,) -inf where banned
    candidates = [Candidate(i, float(raw[i]), float(model[i]), float(adjusted[i]), float(probs[i]),
                            CUT_REASONS[int(reason[i]) - 1] if reason[i] else None, float(moved[i]))
                  for i in ids]
    return StepRecord(
        index=0, token_id=chosen, prob=float(probs[chosen]), model_prob=float(model[chosen]),
        greedy=params.greedy, temperature=params.temperature, candidates=candidates,
        num_kept=int((probs > 0).sum()),
        num_cut={name: n for name, n in zip(CUT_REASONS, counts[1:]) if n},
        num_penalized=int((finite(processed) & (processed != raw)).sum()))
