"""The sampler: one fixed pipeline over a batch of rows with per-row params.

Steps, in order:
1. raw logprobs = log_softmax(model logits), if any row asked for logprobs
   (reported values are the model's own distribution, before any processing);
2. processors (processors.py): logit bias, min_tokens, bad words, n-gram blocking,
   repetition/frequency/presence penalties, DRY; then the grammar mask (structured output);
3. greedy rows (temperature 0): argmax of the processed logits;
4. other rows: the filter chain (chain.py: temperature, top-n-sigma, top-k, typical-p,
   top-p, min-p, XTC, epsilon, eta, or the request's own order; mirostat instead where
   asked); renormalize and draw by inverting the cumulative distribution: one uniform u per row, the first token
   whose float64 running sum of p exceeds u x the total (exact up to float64
   rounding, without a device sync; one random number per row where the exponential
   race argmax(p / E) draws one per vocabulary entry, a visible share of a CPU step at
   large batches: docs/BENCHMARKS.md, 'Measurements behind design choices'). Seeded rows
   draw u from their own generator,
   so a seed reproduces its output whatever else is in the batch;
5. mirostat rows move their mu by the chosen token's surprise.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from tokenloom.explain.compute import explain_row
from tokenloom.explain.records import StepRecord
from tokenloom.outputs import TokenLogprobs
from tokenloom.sampling import device
from tokenloom.sampling.chain import distribution_columns, expand, row_argmax
from tokenloom.sampling.logprobs import logprob_entries
from tokenloom.sampling.metadata import SamplingMetadata
from tokenloom.sampling.mirostat import next_mu
from tokenloom.sampling.processors import apply_processors
from tokenloom.sampling.sparse import take_rows


def inverse_cdf_draw(probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """One draw per row from `probs` (B, V), rows summing to ~1: the first token whose running sum
    exceeds u x the row's total, u ~ U[0, 1) from the row's generator (its own stream if seeded).
    Tokens of probability 0 are never drawn (their running sum does not rise past the one before)."""
    u = torch.empty(probs.shape[0], 1, dtype=torch.float64)
    unseeded = [i for i, g in enumerate(generators) if g is None]
    if unseeded:
        u[unseeded] = torch.rand(len(unseeded), 1, dtype=torch.float64)
    for i, g in enumerate(generators):
        if g is not None:
            u[i] = torch.rand(1, generator=g, dtype=torch.float64)
    cdf = probs.to(torch.float64).cumsum(-1)  # (B, V)
    total = cdf[:, -1:]  # (B, 1)
    target = torch.minimum(u.to(cdf.device) * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, target, right=True).squeeze(1)  # (B,): below total, so < V


@dataclass(slots=True)
class SamplerOutput:
    tokens: torch.Tensor  # (B,) int64
    logprobs: list[TokenLogprobs | None]  # per row, when its request asked
    explanations: list[StepRecord | None]  # per row, when its request asked (explain=N)


class Sampler:
    def sample(
        self, logits: torch.Tensor, meta: SamplingMetadata, constrain: Callable[[torch.Tensor], None] | None = None
    ) -> SamplerOutput:
        """The whole pipeline on float32 logits (B, V).

        `constrain` masks disallowed tokens in place (structured output) after the
        processors; reported logprobs stay the model's raw ones. Rows whose params ask
        for `explain` also get a StepRecord of what each stage did. GPU logits whose rows
        use only the common settings take the device path (device.py: no host sync).
        """
        if constrain is None and device.takes(logits, meta):
            tokens, logprobs = device.sample_on_device(logits, meta)
            return SamplerOutput(tokens, logprobs, [None] * meta.num_rows)
        raw_logprobs = logits.log_softmax(-1) if meta.max_logprobs is not None else None
        explained = [i for i, p in enumerate(meta.params) if p.explain]
        raw = logits[explained]  # (E, V) copies: constrain writes
        logits = apply_processors(logits, meta)  # in place, maybe into `logits`
        processed = logits[explained]  # (E, V) before the grammar mask
        if constrain is not None:
            constrain(logits)
        chosen = row_argmax(logits)
        rows = [i for i, p in enumerate(meta.params) if not p.greedy]
        drawn_from: dict[int, torch.Tensor] = {}
        if rows:
            drawn, drawn_probs, drawn_from = self._draw(logits, meta, rows, explained)
            chosen[rows] = drawn
            update_mirostat(meta.rows(rows), drawn_probs)
        logprobs = (
            [None] * meta.num_rows
            if raw_logprobs is None
            else logprob_entries(raw_logprobs, chosen, [p.logprobs for p in meta.params])
        )
        explanations: list[StepRecord | None] = [None] * meta.num_rows
        for j, i in enumerate(explained):
            explanations[i] = explain_row(
                raw[j], processed[j], logits[i], int(chosen[i]), meta.rows([i]), drawn_from.get(i)
            )
        return SamplerOutput(chosen, logprobs, explanations)

    @staticmethod
    def _draw(logits: torch.Tensor, meta: SamplingMetadata, rows: list[int], explained: list[int]):
        """Draw the sampled `rows` of processed logits (B, V) -> (their tokens (S,), each token's
        probability (S,), {row: its distribution (V,)} for the explained ones). The draw runs over the
        columns the chain kept, put in vocabulary order first, so a seeded row draws the same token
        however wide its batch's columns are (the running sums match the full row's)."""
        probs, columns = distribution_columns(take_rows(logits, rows), meta.rows(rows))  # (S, W), (S, W) | None
        if columns is not None:
            columns, order = columns.sort(dim=1)
            probs = probs.gather(1, order)
        local = inverse_cdf_draw(probs, [meta.generators[i] for i in rows])  # (S,)
        tokens = local if columns is None else columns.gather(1, local[:, None])[:, 0]
        chosen_probs = probs.gather(1, local[:, None])[:, 0]
        asked = set(explained)
        wanted = [j for j, i in enumerate(rows) if i in asked]
        full = expand(probs[wanted], None if columns is None else columns[wanted], logits.shape[1])
        return tokens, chosen_probs, {rows[j]: full[k] for k, j in enumerate(wanted)}


def update_mirostat(meta: SamplingMetadata, chosen_probs: torch.Tensor) -> None:
    """Move each mirostat row's mu by the surprise of its chosen token, whose probability in the
    distribution it was drawn from is `chosen_probs` (R,)."""
    rows = [i for i, p in enumerate(meta.params) if p.mirostat]
    if not rows:
        return
    drawn = chosen_probs[rows].tolist()
    assert meta.states is not None  # __post_init__ fills it
    for i, p_chosen in zip(rows, drawn):
        p, state = meta.params[i], meta.states[i]
        state.mirostat_mu = next_mu(state.mirostat_mu, p_chosen, p.mirostat_tau, p.mirostat_eta)
