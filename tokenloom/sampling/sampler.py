"""The sampler: one fixed pipeline over a batch of rows with per-row params.

Steps, in order:
1. raw logprobs = log_softmax(model logits), if any row asked for logprobs
   (reported values are the model's own distribution, before any processing);
2. processors: logit bias, min_tokens, repetition/frequency/presence penalties;
3. greedy rows (temperature 0): argmax of the processed logits;
4. other rows: divide by temperature, then keep the top-k, then the top-p
   nucleus, then tokens with prob >= min_p x max prob; renormalize and draw
   with the exponential race argmax(p / E), E ~ Exp(1), which samples exactly
   from p without a device sync. Seeded rows draw E from their own generator, so
   a seed reproduces its output whatever else is in the batch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from tokenloom.explain.compute import explain_row
from tokenloom.explain.records import StepRecord
from tokenloom.outputs import TokenLogprobs
from tokenloom.sampling.filters import greedy_and_distribution, row_argmax
from tokenloom.sampling.logprobs import logprob_entries
from tokenloom.sampling.metadata import SamplingMetadata
from tokenloom.sampling.processors import apply_processors


def exponential_race(probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """One draw per row from `probs` (B, V): argmax(p / E), E ~ Exp(1)."""
    noise = torch.empty_like(probs)
    unseeded = [i for i, g in enumerate(generators) if g is None]
    if unseeded:
        noise[unseeded] = torch.empty(len(unseeded), probs.shape[1], device=probs.device).exponential_()
    for i, g in enumerate(generators):
        if g is not None:
            noise[i] = torch.empty(probs.shape[1]).exponential_(generator=g).to(probs.device)
    return row_argmax(probs / noise)



@dataclass(slots=True)
class SamplerOutput:
    tokens: torch.Tensor                                  # (B,) int64
    logprobs: list[TokenLogprobs | None]                  # per row, when its request asked
    explanations: list[StepRecord | None]                 # per row, when its request asked (explain=N)


class Sampler:
    def sample(self, logits: torch.Tensor, meta: SamplingMetadata,
               constrain: Callable[[torch.Tensor], None] | None = None) -> SamplerOutput:
        """The whole pipeline on float32 logits (B, V).

        `constrain` masks disallowed tokens in place (structured output) after the
        processors; reported logprobs stay the model's raw ones. Rows whose params ask
        for `explain` also get a StepRecord of what each stage did.
        """
        raw_logprobs = logits.log_softmax(-1) if meta.max_logprobs is not None else None
        explained = [i for i, p in enumerate(meta.params) if p.explain]
        raw = logits[explained]                                           # (E, V) copies: constrain writes
        logits = apply_processors(logits, meta)                           # in place, maybe into `logits`
        processed = logits[explained]                                     # (E, V) before the grammar mask
        if constrain is not None:
            constrain(logits)
        chosen, rows, probs = greedy_and_distribution(logits, meta)
        if rows:
            chosen[rows] = exponential_race(probs, [meta.generators[i] for i in rows])
        logprobs = ([None] * meta.num_rows if raw_logprobs is None
                    else logprob_entries(raw_logprobs, chosen, [p.logprobs for p in meta.params]))
        explanations: list[StepRecord | None] = [None] * meta.num_rows
        for j, i in enumerate(explained):
            p = meta.params[i]
            explanations[i] = explain_row(raw[j], processed[j], logits[i], int(chosen[i]), p, p.explain)
        return SamplerOutput(chosen, logprobs, explanations)
