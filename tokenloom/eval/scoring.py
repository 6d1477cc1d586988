"""Log-probabilities of given tokens, and perplexity over a text, in prefill passes.

Both run on the engine itself, so they measure exactly the model it serves: its dtype,
its quantization, its KV cache. ``score_tokens`` is a scoring request (prompt logprobs) like
any other, the one scoring path (``LLM.score``, perplexity, the server's echo all take it);
``LLMEngine.prefill_logits`` gives full logits, for comparing two engines (``agreement``).
"""

from __future__ import annotations

import math
import uuid
from dataclasses import dataclass
from importlib import resources

from tokenloom.outputs import RequestError
from tokenloom.sampling_params import SamplingParams


def score_tokens(engine, token_ids: list[int], start: int = 1) -> list[float]:
    """log p(token_ids[i] | token_ids[:i]) for i = start .. n-1 (natural logs; start >= 1).

    One scoring request (prompt_logprobs, max_tokens=0) stepped through the idle engine
    (RuntimeError otherwise): the path of LLM.score, perplexity and the server's echo + logprobs.
    """
    if not 1 <= start < len(token_ids):
        raise ValueError(f"scoring needs tokens after the first {start}, got {len(token_ids)} tokens")
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
                entries = done.completion.prompt_logprobs[start:]
                return [entry[token] for entry, token in zip(entries, token_ids[start:])]
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
        piece = token_ids[start : start + window]
        if len(piece) < 2:
            break
        nll.extend(-lp for lp in score_tokens(engine, piece))
        windows += 1
    mean = sum(nll) / len(nll)
    return PerplexityResult(math.exp(mean), len(nll), windows, mean)


def default_eval_text() -> str:
    """The public-domain text shipped for perplexity (tokenloom/data/declaration.txt)."""
    return resources.files("tokenloom").joinpath("data/declaration.txt").read_text(encoding="utf-8")
