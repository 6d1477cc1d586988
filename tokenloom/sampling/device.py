"""The sampler's device path: the common settings without a host sync, for logits on a GPU.

Rows whose settings are greedy, temperature, top-k, top-p, min-p, repetition / frequency /
presence penalties and seeds (in the default filter order) are sampled here; anything else
(logit bias, min_tokens, bad words, n-gram blocking, DRY, the other filters, mirostat, a custom
order, a grammar, explain records) takes the general sampler (sampler.py), whose Python looks at
values (``int(k.max())``, ``torch.unique``) and so waits for the device.

What the host knows it sends in one pinned, asynchronous copy (each row's settings, its uniform
draw, its history for the penalties); nothing comes back until the caller reads the chosen
tokens. The arithmetic is the general sampler's, vectorized over whole rows:

- penalties (processors.apply_penalties): repetition over the last repetition_penalty_range
  tokens of prompt + output (each token once), then frequency x count + presence for the
  output tokens among them;
- greedy rows: argmax of the penalized logits;
- sampled rows: top-k (the raw logits' k-th largest, ties kept), temperature, top-p (the
  smallest most-likely set whose probability reaches p), min-p (below min_p x the top
  probability), softmax; then the inverse-CDF draw over the survivors in vocabulary order with
  the row's own u (its seeded generator's, else the global one's: the same u the general
  sampler draws), so a seed gives the same token on either path up to float rounding.
Where every sampled row has a top-k, the filters work on the K = max(top_k) largest logits only.
"""

from __future__ import annotations

import torch

from tokenloom.memory.transfer import to_device
from tokenloom.outputs import TokenLogprobs
from tokenloom.sampling.logprobs import logprob_entries
from tokenloom.sampling.metadata import SamplingMetadata
from tokenloom.sampling.sparse import last_columns, right_aligned
from tokenloom.sampling.state import dry_enabled
from tokenloom.sampling_params import DEFAULT_SAMPLERS, SamplingParams

NEG_INF = float("-inf")


def row_takes(p: SamplingParams, num_outputs: int) -> bool:
    """This row's settings are all ones the device path computes."""
    return (
        not p.logit_bias
        and (p.min_tokens == 0 or num_outputs >= p.min_tokens)
        and not p.bad_words
        and not p.no_repeat_ngram_size
        and not dry_enabled(p)
        and not p.explain
        and not p.mirostat
        and p.sampler_order == DEFAULT_SAMPLERS
        and p.typical_p >= 1
        and p.top_n_sigma <= 0
        and p.xtc_probability <= 0
        and p.epsilon_cutoff <= 0
        and p.eta_cutoff <= 0
    )


def takes(logits: torch.Tensor, meta: SamplingMetadata) -> bool:
    """Logits on a GPU, and every row's settings computed here."""
    return logits.is_cuda and all(row_takes(p, len(o)) for p, o in zip(meta.params, meta.output_token_ids))


def _penalized(logits: torch.Tensor, meta: SamplingMetadata, settings: torch.Tensor) -> torch.Tensor:
    """logits (B, V) with the rows' penalties applied (a new tensor). settings: (B, 8) on the device."""
    B, V = logits.shape
    ids = to_device(right_aligned(meta.histories()), logits.device)  # (B, L)
    rep, freq, pres = settings[:, 4:5], settings[:, 5:6], settings[:, 6:7]
    window = settings[:, 7].to(torch.int64)
    window = torch.where(window > 0, window, ids.shape[1])
    seen = last_columns(ids, window)  # (B, L)
    column = torch.where(seen, ids, V)  # V: nothing
    was_seen = torch.zeros(B, V + 1, dtype=torch.bool, device=logits.device).scatter_(1, column, True)[:, :V]
    out = torch.where(was_seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
    outputs = seen & last_columns(ids, to_device(torch.tensor([len(o) for o in meta.output_token_ids]), logits.device))
    counts = torch.zeros(B, V + 1, dtype=logits.dtype, device=logits.device)
    counts.scatter_add_(1, torch.where(outputs, ids, V), torch.ones_like(ids, dtype=logits.dtype))
    counts = counts[:, :V]
    return out - torch.where(counts > 0, freq * counts + pres, 0.0)


def _filtered(
    logits: torch.Tensor, settings: torch.Tensor, top_k: list[int], top_p_on: bool, min_p_on: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Probabilities after top-k, temperature, top-p and min-p: (probs (B, W), their columns (B, W)
    in vocabulary order, or None for all V in order). top_k: the sampled rows' settings (0: off),
    which decide whether the rows can be narrowed to the widest k's columns."""
    columns = None
    x = logits
    widest = min(max(top_k), x.shape[1])
    if all(k > 0 for k in top_k):  # narrow to the widest k's columns
        x, columns = x.topk(widest, dim=-1)  # (B, K) descending
    if widest > 0:
        k = settings[:, 1:2].to(torch.int64)  # (B, 1), 0: off
        ranked = x if columns is not None else x.topk(widest, dim=-1).values
        kth = ranked.gather(1, (k.clamp(min=1, max=ranked.shape[1]) - 1))
        kth = torch.where(k > 0, kth, NEG_INF)
        x = x.masked_fill(x < kth, NEG_INF)
    x = x / settings[:, 0:1]  # temperature
    if top_p_on:
        probs = x.softmax(-1)
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        above = sorted_probs.cumsum(-1) - sorted_probs  # mass strictly above
        drop_sorted = above >= settings[:, 2:3]
        drop_sorted[:, 0] = False  # the most likely token always stays (a tiny top_p may read as 0)
        drop = torch.zeros_like(drop_sorted).scatter_(1, order, drop_sorted)
        x = x.masked_fill(drop, NEG_INF)
    if min_p_on:
        probs = x.softmax(-1)
        x = x.masked_fill(probs < probs.max(-1, keepdim=True).values * settings[:, 3:4], NEG_INF)
    probs = x.softmax(-1)
    if columns is not None:  # vocabulary order, for the draw
        columns, order = columns.sort(dim=1)
        probs = probs.gather(1, order)
    return probs, columns


def _draw(probs: torch.Tensor, columns: torch.Tensor | None, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw: for each row the first column whose float64 running sum exceeds u x total."""
    cdf = probs.to(torch.float64).cumsum(-1)
    total = cdf[:, -1:]
    target = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
    local = torch.searchsorted(cdf, target, right=True).clamp_(max=cdf.shape[1] - 1)  # (B, 1)
    return (local if columns is None else columns.gather(1, local))[:, 0]


def _host_settings(meta: SamplingMetadata) -> torch.Tensor:
    """(B, 9) float64 on the host: temperature (1 for greedy), top_k, top_p, min_p, repetition,
    frequency, presence, penalty window, u; u drawn per row as the general sampler draws it."""
    rows = []
    unseeded = [i for i, (p, g) in enumerate(zip(meta.params, meta.generators)) if g is None and not p.greedy]
    shared = torch.rand(len(unseeded), dtype=torch.float64).tolist() if unseeded else []
    draws = dict(zip(unseeded, shared))
    for i, (p, g) in enumerate(zip(meta.params, meta.generators)):
        u = 0.0 if p.greedy else (draws[i] if g is None else float(torch.rand(1, generator=g, dtype=torch.float64)))
        rows.append(
            [
                1.0 if p.greedy else p.temperature,
                max(p.top_k, 0),
                p.top_p,
                p.min_p,
                p.repetition_penalty,
                p.frequency_penalty,
                p.presence_penalty,
                p.repetition_penalty_range,
                u,
            ]
        )
    return torch.tensor(rows, dtype=torch.float64)


def sample_on_device(logits: torch.Tensor, meta: SamplingMetadata) -> tuple[torch.Tensor, list[TokenLogprobs | None]]:
    """Float32 logits (B, V) on a GPU whose rows ``takes`` -> (chosen tokens (B,) on the device, per
    row its logprob entries where asked). Nothing waits for the device before the entries."""
    params = meta.params
    sampled_rows = [i for i, p in enumerate(params) if not p.greedy]
    penalized = any(p.repetition_penalty != 1 or p.frequency_penalty or p.presence_penalty for p in params)
    raw_logprobs = logits.log_softmax(-1) if meta.max_logprobs is not None else None
    if sampled_rows or penalized:
        device = to_device(_host_settings(meta), logits.device)
        settings, u = device[:, :8].to(logits.dtype), device[:, 8:9]
    if penalized:
        logits = _penalized(logits, meta, settings)
    chosen = logits.argmax(-1)
    if sampled_rows:  # greedy rows are drawn too, and their draw dropped
        sampled = [params[i] for i in sampled_rows]
        probs, columns = _filtered(
            logits,
            settings,
            [max(p.top_k, 0) for p in sampled],
            any(p.top_p < 1 for p in sampled),
            any(p.min_p > 0 for p in sampled),
        )
        drawn = _draw(probs, columns, u)
        if len(sampled_rows) < len(params):
            greedy = to_device(torch.tensor([p.greedy for p in params]), logits.device)
            chosen = torch.where(greedy, chosen, drawn)
        else:
            chosen = drawn
    entries: list[TokenLogprobs | None] = (
        [None] * len(params)
        if raw_logprobs is None
        else logprob_entries(raw_logprobs, chosen, [p.logprobs for p in params])
    )
    return chosen, entries
