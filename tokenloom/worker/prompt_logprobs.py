"""Log-probabilities of the prompt's own tokens, computed during prefill (scoring).

For a request with ``SamplingParams.prompt_logprobs = N``, every prefill chunk's hidden
states at positions p (whose next token p+1 is still in the prompt) go through the output
head; the entry for prompt token p+1 is ``{token: logprob}`` for that token and the N most
likely ones, raw model log-probabilities (no sampling processors), like vLLM's.
The first prompt token has no entry (None): nothing predicts it.
"""

from __future__ import annotations

from typing import cast

import torch

from tokenloom.outputs import TokenLogprobs
from tokenloom.sampling.logprobs import logprob_entries

ROWS_PER_SLICE = 256  # logits of 256 rows x a 150k vocabulary: 150 MB of float32 at most


@torch.inference_mode()
def prompt_logprobs(model, hidden: torch.Tensor, targets: list[int], top_n: int) -> list[TokenLogprobs]:
    """hidden (len(targets), hidden): row i predicts targets[i] -> one entry per row."""
    out: list[TokenLogprobs] = []
    for lo in range(0, len(targets), ROWS_PER_SLICE):
        logprobs = torch.log_softmax(model.compute_logits(hidden[lo : lo + ROWS_PER_SLICE]), dim=-1)  # (r, vocab)
        chosen = torch.tensor(targets[lo : lo + ROWS_PER_SLICE], device=logprobs.device)
        out.extend(cast("list[TokenLogprobs]", logprob_entries(logprobs, chosen, [top_n] * len(chosen))))  # no None
    return out


def chunk_targets(prompt: list[int], start: int, num_tokens: int) -> tuple[int, list[int]]:
    """For a chunk at positions start .. start+num_tokens-1: how many of its rows predict a
    prompt token, and those tokens (prompt[start+1 : ...])."""
    end = min(start + num_tokens, len(prompt) - 1)
    return max(0, end - start), prompt[start + 1 : end + 1]
