"""Log-probabilities of given tokens, and perplexity over a text, in prefill passes.

Both run on the engine itself, so they measure exactly the model it serves: its dtype,
its quantization, its KV cache. ``prefill_logits`` (full logits, for comparisons) borrows
KV blocks for one sequence and runs the model in chunks; ``score_tokens`` is a scoring
request (prompt logprobs) like any other.
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from importlib import resources

import torch

from tokenloom.batch import SeqChunk
from tokenloom.outputs import RequestError
from tokenloom.sampling_params import SamplingParams


@torch.inference_mode()
def prefill_logits(engine, token_ids: list[int], chunk_size: int = 128) -> Iterator[tuple[int, torch.Tensor]]:
    """(start, logits) per chunk: float32 logits (len(chunk), vocab) for the positions
    start .. start + len(chunk) - 1 of `token_ids`, each predicting the next token.

    Runs while the engine is idle (raises RuntimeError otherwise); the sequence must
    fit the context and the free KV blocks (ValueError otherwise). Chunks after the
    first read the earlier tokens' keys and values from the KV cache, as decoding does.
    """
    n = len(token_ids)
    if n > engine.max_model_len:
        raise ValueError(f"{n} tokens exceed the model's context of {engine.max_model_len}")
    runner = engine.runner
    with engine.scheduler.borrowed_blocks(n) as blocks:
        for start in range(0, n, chunk_size):
            hidden, _ = runner.forward([SeqChunk(token_ids[start:start + chunk_size], start, blocks)])
            yield start, runner.model.compute_logits(hidden)                  # (len, vocab)


def score_tokens(engine, token_ids: list[int]) -> list[float]:
    """log p(token_ids[i] | token_ids[:i]) for i = 1 .. n-1 (n-1 floats, natural log).

    One scoring request (prompt_logprobs, max_tokens=0) stepped through the idle engine:
    the same path as LLM.score and the server's echo + logprobs.
    """
    if len(token_ids) < 2:
        raise ValueError("scoring needs at least two tokens")
    if engine.has_unfinished_requests():
        raise RuntimeError("scoring runs only while the engine has no requests in flight")
    request_id = f"score-{uuid.uuid4().hex}"
    engine.add_request(request_id, token_ids, SamplingParams(max_tokens=0, prompt_logprobs=0))
    try:
        while True:
            done = next((d for d in engine.step() if d.request_id == request_id and d.finished), None)
            if done is not None:
                if done.error is not None:
                    raise RequestError(f"scoring failed: {done.error}")
                entries = done.completion.prompt_logprobs[1:]
                return [entry[token] for entry, token in zip(entries, token_ids[1:])]
    finally:
        engine.abort(request_id)


@dataclass
class PerplexityResult:
    perplexity: float
    tokens_scored: int
    windows: int
    nll_mean: float


def perplexity(engine, token_ids: list[int], window: int = 512) -> PerplexityResult:
    """exp(mean NLL) over non-overlapping windows of `window` tokens, each scored from scratch.

    Every token but the first of each window is predicted from the window's earlier
    tokens only (HF's and llama.cpp's usual fixed-context perplexity).
    """
    if window < 2:
        raise ValueError(f"window must be at least 2 tokens, got {window}")
    nll: list[float] = []
    windows = 0
    for start in range(0, len(token_ids) - 1, window):
        piece = token_ids[start:start + window]
        if len(piece) < 2:
            break
        nll.extend(-lp for lp in score_tokens(engine, piece))
        windows += 1
    mean = sum(nll) / len(nll)
    return PerplexityResult(math.exp(mean), len(nll), windows, mean)


def default_eval_text() -> str:
    """The public-domain text shipped for perplexity (tokenloom/data/declaration.txt)."""
    return resources.files("tokenloom").joinpath("data/declaration.txt").read_text(encoding="utf-8")
