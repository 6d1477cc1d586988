"""Verify draft tokens against the target's logits at every draft position, for many requests at once.

A request with k drafts owns k + 1 consecutive logits rows (positions of its last
token and of each draft). Row j is processed as if the drafts before it had been
generated (penalties and min_tokens see them), with the same pipeline as plain
sampling, then the acceptance rule of `rejection.py` picks the new tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenloom.outputs import TokenLogprobs
from tokenloom.request import Request
from tokenloom.sampling.chain import greedy_and_distribution
from tokenloom.sampling.logprobs import logprob_entries
from tokenloom.sampling.metadata import SamplingMetadata
from tokenloom.sampling.processors import apply_processors
from tokenloom.spec_decode.rejection import accept_greedy, accept_sampled


@dataclass(slots=True)
class Draft:
    """One request's proposal: tokens, and the distributions they were drawn from (None: deterministic)."""

    request: Request
    token_ids: list[int]
    probs: torch.Tensor | None = None     # (k, V)


def _expanded_metadata(drafts: list[Draft]) -> SamplingMetadata:
    """One row per draft position: row j of a request sees its outputs plus drafts[:j]."""
    requests, outputs = [], []
    for d in drafts:
        for j in range(len(d.token_ids) + 1):
            requests.append(d.request)
            outputs.append(d.request.output_token_ids + d.token_ids[:j])
    return SamplingMetadata.for_requests(requests, outputs)


def verify(logits: torch.Tensor, drafts: list[Draft]) -> list[tuple[list[int], list[TokenLogprobs] | None]]:
    """logits: float32 (sum(k_i + 1), V), rows grouped per request in `drafts` order.

    Returns per request: its new tokens (accepted drafts + one target token) and,
    if it asked for logprobs, the raw model logprobs of each.
    """
    meta = _expanded_metadata(drafts)
    processed = apply_processors(logits.clone(), meta)
    argmax, sampled_rows, sampled_probs = greedy_and_distribution(processed, meta)
    argmax = argmax.tolist()
    probs = torch.zeros(0)
    if sampled_rows:
        probs = torch.zeros_like(processed)
        probs[sampled_rows] = sampled_probs
    results = []
    row = 0
    for d in drafts:
        k, params = len(d.token_ids), d.request.params
        if params.greedy:
            tokens = accept_greedy(argmax[row:row + k + 1], d.token_ids)
        else:
            tokens = accept_sampled(probs[row:row + k + 1], d.token_ids, d.probs, d.request.generator)
        logprobs = None
        if params.logprobs is not None:
            raw = logits[row:row + len(tokens)].log_softmax(-1)                 # (accepted + 1, V)
            chosen = torch.tensor(tokens, device=logits.device)
            logprobs = logprob_entries(raw, chosen, [params.logprobs] * len(tokens))
        results.append((tokens, logprobs))
        row += k + 1
    return results
