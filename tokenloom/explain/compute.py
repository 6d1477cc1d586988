"""StepRecords from the sampler's tensors: the same processors and filters the sampler applies,
replayed one stage at a time on one row to say what each did.

Only rows whose request asked (``SamplingParams.explain``) pay for this.
"""

from __future__ import annotations

import torch

from tokenloom.explain.records import CUT_REASONS, Candidate, StepRecord
from tokenloom.sampling.chain import FILTERS, row_stages
from tokenloom.sampling.metadata import SamplingMetadata
from tokenloom.sampling.processors import PROCESSORS

_OWN_REASON = {"bad_words", "no_repeat_ngram"}  # processors whose bans are named after them


class _Cuts:
    """Per token (V,): 0 kept, i: removed by CUT_REASONS[i - 1] (the first stage that removed it)."""

    def __init__(self, vocab: int) -> None:
        self.reason = torch.zeros(vocab, dtype=torch.int8)

    def mark(self, before: torch.Tensor, after: torch.Tensor, name: str) -> None:
        removed = ~torch.isfinite(after) & torch.isfinite(before) & (self.reason == 0)
        self.reason[removed] = CUT_REASONS.index(name) + 1

    def counts(self) -> dict[str, int]:
        counts = torch.bincount(self.reason.long(), minlength=len(CUT_REASONS) + 1).tolist()
        return {name: n for name, n in zip(CUT_REASONS, counts[1:]) if n}

    def of(self, token: int) -> str | None:
        return CUT_REASONS[int(self.reason[token]) - 1] if self.reason[token] else None


def _replay_processors(raw: torch.Tensor, meta: SamplingMetadata, cuts: _Cuts) -> dict[str, int]:
    """Run the row's processors one by one on raw (V,): mark their bans, count the tokens each moved."""
    moved, logits = {}, raw[None]
    for name, used, processor in PROCESSORS:
        if not used(meta):
            continue
        after = logits.clone()
        processor(after, meta)
        cuts.mark(logits[0], after[0], name if name in _OWN_REASON else "banned")
        shifted = int((torch.isfinite(after) & (after != logits)).sum())
        if shifted:
            moved[name] = shifted
        logits = after
    return moved


def explain_row(
    raw: torch.Tensor,
    processed: torch.Tensor,
    constrained: torch.Tensor,
    chosen: int,
    meta: SamplingMetadata,
    drawn_from: torch.Tensor | None,
) -> StepRecord:
    """One row's record. raw / processed / constrained: its logits (V,) float32 as the model gave
    them, after the processors, and after the grammar mask; `chosen`: the token the sampler
    picked; `meta`: the row's metadata (one row); `drawn_from`: the distribution (V,) it was drawn
    from (None: greedy). Lists the top `explain` candidates by adjusted probability, then `chosen`."""
    assert meta.states is not None  # __post_init__ fills it
    params, state = meta.params[0], meta.states[0]
    cuts = _Cuts(raw.shape[0])
    moved = _replay_processors(raw, meta, cuts)
    cuts.mark(processed, constrained, "grammar")
    if not params.greedy:
        logits = constrained[None]  # (1, V)
        for name in row_stages(params):
            if name == "xtc" and not params.xtc_probability:
                continue
            after = FILTERS[name](logits, [params], [state])
            if name in CUT_REASONS:
                cuts.mark(logits[0], after[0], name)
            logits = after if name != "xtc" else logits  # XTC cuts only where it fires: the rest see all
    adjusted = (constrained / (params.temperature if params.temperature > 0 else 1.0)).softmax(-1)
    model = raw.softmax(-1)
    probs = adjusted if drawn_from is None else drawn_from.to(adjusted.dtype)
    assert params.explain is not None  # only rows that ask are explained
    ids = adjusted.topk(min(params.explain, adjusted.shape[0])).indices.tolist()
    if chosen not in ids:
        ids.append(chosen)
    shift = processed - raw  # (V,) -inf where banned
    candidates = [
        Candidate(i, float(raw[i]), float(model[i]), float(adjusted[i]), float(probs[i]), cuts.of(i), float(shift[i]))
        for i in ids
    ]
    return StepRecord(
        index=0,
        token_id=chosen,
        prob=float(probs[chosen]),
        model_prob=float(model[chosen]),
        greedy=params.greedy,
        temperature=params.temperature,
        candidates=candidates,
        num_kept=int((probs > 0).sum()),
        num_cut=cuts.counts(),
        num_penalized=int((torch.isfinite(processed) & (processed != raw)).sum()),
        num_moved=moved,
    )
