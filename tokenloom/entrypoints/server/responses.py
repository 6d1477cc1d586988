"""OpenAI response shapes: plain dicts built from engine outputs (no engine calls here)."""

from __future__ import annotations

import time
from typing import Any

from tokenloom.outputs import TokenLogprobs
from tokenloom.tokenizer import Tokenizer


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> dict:
    """OpenAI's usage; `cached_tokens`: prompt tokens served from the prefix cache, if known."""
    body: dict = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    if cached_tokens is not None:
        body["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return body


def cached_tokens(outs: list) -> int:
    """Prompt tokens the completions' requests found in the prefix cache."""
    return sum(o.metrics.num_cached_prompt_tokens for o in outs if o is not None and o.metrics is not None)


def envelope(
    kind: str, response_id: str, created: int, model: str, choices: list[dict], usage_counts: dict | None = None
) -> dict[str, Any]:
    """The fields every response and chunk carries around its choices."""
    body: dict[str, Any] = {"id": response_id, "object": kind, "created": created, "model": model, "choices": choices}
    if usage_counts is not None:
        body["usage"] = usage_counts
    return body


def with_explanation(choice: dict, records: list | None, prompt_ids: list[int] | None) -> dict:
    """tokenloom's `explain` extension on a choice: the tokens' StepRecords, and (given once per
    choice) the prompt's token ids, so a client can branch from any step by sending ids."""
    choice["explain"] = [r.to_dict() for r in records or ()]
    if prompt_ids is not None:
        choice["prompt_token_ids"] = prompt_ids
    return choice


def now() -> int:
    return int(time.time())


def _top(logprobs: TokenLogprobs, n: int) -> list[tuple[int, float]]:
    """The n most likely (token id, logprob) pairs, best first (ties: lower id first)."""
    return sorted(logprobs.items(), key=lambda kv: (-kv[1], kv[0]))[:n]


class LogprobFormatter:
    """Turns the engine's {token_id: logprob} per position into OpenAI's two logprob shapes."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer

    def text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def completion(
        self, token_ids: list[int], logprobs: list[TokenLogprobs], top_n: int, text_offset: int
    ) -> dict[str, list]:
        """Legacy completions shape: parallel lists, top_logprobs as {token text: logprob}."""
        out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for token, lp in zip(token_ids, logprobs):
            text = self.text(token)
            out["tokens"].append(text)
            out["token_logprobs"].append(None if lp is None else lp[token])  # None: a prompt's first token
            out["top_logprobs"].append(None if lp is None else {self.text(t): v for t, v in _top(lp, top_n)})
            out["text_offset"].append(text_offset)
            text_offset += len(text)
        return out

    def _entry(self, token: int, logprob: float) -> dict[str, Any]:
        text = self.text(token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    def chat(self, token_ids: list[int], logprobs: list[TokenLogprobs], top_n: int) -> dict[str, list]:
        """Chat shape: {"content": [{token, logprob, bytes, top_logprobs: [...]}]}."""
        content = []
        for token, lp in zip(token_ids, logprobs):
            entry = self._entry(token, lp[token])
            entry["top_logprobs"] = [self._entry(t, v) for t, v in _top(lp, top_n)]
            content.append(entry)
        return {"content": content}
