"""Verify draft tokens against the target's logits at every draft position, for many requests at once.

A request with k drafts owns k + 1 consecutive logits rows (positions of its last
token and of each draft). Row j is processed as if the drafts before it had been
generated (processors see them; a mirostat row's mu has moved by each draft's surprise),
with the same pipeline as plain sampling, then the acceptance rule of `rejection.py`
picks the new tokens.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import torch

from tokenloom.outputs import TokenLogprobs
from tokenloom.sampling.chain import greedy_and_distribution, sampling_distribution
from tokenloom.sampling.logprobs import logprob_entries
from tokenloom.sampling.metadata import SamplingMetadata
from tokenloom.sampling.mirostat import next_mu
from tokenloom.sampling.processors import apply_processors
from tokenloom.spec_decode.rejection import accept_greedy, accept_sampled

if TYPE_CHECKING:
    from tokenloom.engine.request import Request
    from tokenloom.sampling.state import SamplingState


@dataclass(slots=True)
class Draft:
    """One request's proposal: tokens, and the distributions they were drawn from (None: deterministic)."""

    request: Request
    token_ids: list[int]
    probs: torch.Tensor | None = None  # (k, V)


def _expanded_metadata(drafts: list[Draft]) -> SamplingMetadata:
    """One row per draft position: row j of a request sees its outputs plus drafts[:j]."""
    requests, outputs = [], []
    for d in drafts:
        for j in range(len(d.token_ids) + 1):
            requests.append(d.request)
            outputs.append(d.request.output_token_ids + d.token_ids[:j])
    return SamplingMetadata.for_requests(requests, outputs)


def _mirostat_distributions(
    processed: torch.Tensor, meta: SamplingMetadata, drafts: list[Draft], probs: torch.Tensor
) -> dict[int, list[float]]:
    """Fill `probs` at the rows of sampled mirostat requests, position by position (row j's mu
    follows the surprise of draft j - 1 in row j - 1's distribution); -> each such request's
    (index in `drafts`) mu per row."""
    starts = [sum(len(d.token_ids) + 1 for d in drafts[:i]) for i in range(len(drafts))]
    mus = {
        i: [cast("SamplingState", d.request.sampling_state).mirostat_mu]
        for i, d in enumerate(drafts)
        if d.request.params.mirostat and not d.request.params.greedy
    }
    for j in range(max((len(drafts[i].token_ids) + 1 for i in mus), default=0)):
        live = [i for i in mus if j <= len(drafts[i].token_ids)]
        rows = [starts[i] + j for i in live]
        row_meta = meta.rows(rows)
        assert row_meta.states is not None  # __post_init__ fills it
        row_meta.states = [dataclasses.replace(s, mirostat_mu=mus[i][j]) for i, s in zip(live, row_meta.states)]
        probs[rows] = sampling_distribution(processed[rows], row_meta)
        for i, row in zip(live, rows):
            if j < len(drafts[i].token_ids):
                p, drawn = drafts[i].request.params, float(probs[row, drafts[i].token_ids[j]])
                # a draft the target cannot draw is rejected here: the mu after it is never used
                mus[i].append(next_mu(mus[i][j], drawn, p.mirostat_tau, p.mirostat_eta) if drawn > 0 else mus[i][j])
    return mus


def verify(logits: torch.Tensor, drafts: list[Draft]) -> list[tuple[list[int], list[TokenLogprobs] | None]]:
    """logits: float32 (sum(k_i + 1), V), rows grouped per request in `drafts` order.

    Returns per request: its new tokens (accepted drafts + one target token) and,
    if it asked for logprobs, the raw model logprobs of each. Mirostat requests' mu
    moves past the tokens returned.
    """
    meta = _expanded_metadata(drafts)
    processed = apply_processors(logits, meta)
    argmax_rows, sampled_rows, sampled_probs = greedy_and_distribution(processed, meta)
    argmax = argmax_rows.tolist()
    probs = torch.zeros(0)
    if sampled_rows:
        assert sampled_probs is not None  # rows to sample: their distributions
        probs = torch.zeros_like(processed)
        probs[sampled_rows] = sampled_probs
    mus = _mirostat_distributions(processed, meta, drafts, probs) if any(p.mirostat for p in meta.params) else {}
    results: list[tuple[list[int], list[TokenLogprobs] | None]] = []
    new_mu: dict[int, float] = {}
    row = 0
    for i, d in enumerate(drafts):
        k, params = len(d.token_ids), d.request.params
        if params.greedy:
            tokens = accept_greedy(argmax[row : row + k + 1], d.token_ids)
        else:
            tokens = accept_sampled(probs[row : row + k + 1], d.token_ids, d.probs, d.request.generator)
        if i in mus:
            last = len(tokens) - 1  # tokens[last] was drawn from row + last
            new_mu[i] = next_mu(
                mus[i][last], float(probs[row + last, tokens[last]]), params.mirostat_tau, params.mirostat_eta
            )
        logprobs: list[TokenLogprobs] | None = None
        if params.logprobs is not None:
            raw = logits[row : row + len(tokens)].log_softmax(-1)  # (accepted + 1, V)
            chosen = torch.tensor(tokens, device=logits.device)
            logprobs = cast("list[TokenLogprobs]", logprob_entries(raw, chosen, [params.logprobs] * len(tokens)))
        results.append((tokens, logprobs))
        row += k + 1
    for i, mu in new_mu.items():  # only once every request is through (a retry starts clean)
        state = drafts[i].request.sampling_state
        assert state is not None  # Request.__post_init__ fills it
        state.mirostat_mu = mu
    return results
