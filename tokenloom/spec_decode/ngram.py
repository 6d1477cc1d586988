"""Prompt-lookup (n-gram) drafting: no second model, just the text so far.

If the last n tokens appeared earlier in the prompt or output, the tokens that
followed that occurrence are a good guess for what follows now (summaries,
rewrites, code edits and quotes copy long spans of their input).
"""

from __future__ import annotations


def propose_ngram(token_ids: list[int], k: int, ngram_max: int, ngram_min: int) -> list[int]:
    """Up to k tokens that followed the most recent earlier occurrence of the longest
    suffix of `token_ids` of length ngram_max..ngram_min; [] if there is none."""
    n_tokens = len(token_ids)
    for n in range(min(ngram_max, n_tokens - 1), ngram_min - 1, -1):
        suffix = token_ids[n_tokens - n :]
        first = suffix[0]
        # scan right to left for the latest earlier start position i of `suffix`
        i = n_tokens - n - 1
        while i >= 0:
            try:
                i = _rindex(token_ids, first, i)
            except ValueError:
                break
            if token_ids[i : i + n] == suffix:
                follow = token_ids[i + n : i + n + k]
                if follow:
                    return follow
            i -= 1
    return []


def _rindex(values: list[int], value: int, end: int) -> int:
    """Largest index <= end holding `value` (ValueError if none)."""
    for i in range(end, -1, -1):
        if values[i] == value:
            return i
    raise ValueError(value)
