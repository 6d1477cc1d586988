"""DRY, "don't repeat yourself" (llama.cpp's restatement of p-e-w's sampler), batched over rows.

A token that would extend a repeat, a run of the last tokens that already occurred earlier in
the last `dry_penalty_last_n` tokens of prompt + output, of at least `dry_allowed_length` tokens,
loses multiplier x base^(length - allowed_length) from its logit (the longest repeat it extends
counts; the exponent is clamped so the penalty stays finite in float32). A repeat never reaches
back across a sequence breaker (a token whose text holds one of the breaker strings, or a token
whose text ends with the start of one followed by tokens spelling the rest), and a one-token
breaker is never penalized.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property

import torch

from tokenloom.sampling.sparse import last_columns

FLOAT_MAX_LOG = 88.7228391  # log of float32's largest value: the exponent clamp
MAX_TAIL_TOKENS = 20  # llama.cpp's MAX_SEQ_LEN for a breaker's tail


@dataclass(frozen=True)
class DryBreakers:
    """A set of sequence breakers in token form (llama.cpp's processed breakers)."""

    single: torch.Tensor  # (V,) bool: tokens that break on their own
    heads: torch.Tensor  # (V,) bool: single, or the head of a longer breaker
    tails: dict[int, tuple[tuple[int, ...], ...]]  # head token -> the token tails that complete it

    @cached_property
    def only_single(self) -> torch.Tensor:
        """(V,) bool: tokens that break on their own and head nothing longer."""
        only = self.single.clone()
        for token, tails in self.tails.items():
            only[token] = tails == ((),)
        return only

    @classmethod
    def build(
        cls, breakers: Sequence[str], token_texts: Sequence[str], encode: Callable[[str], list[int]]
    ) -> DryBreakers:
        """`token_texts[i]`: token i's text on its own; `encode`: text -> ids without special tokens."""
        V = len(token_texts)
        tails: dict[int, set[tuple[int, ...]]] = {}
        for breaker in breakers:
            for token, tail in _overlaps(breaker, token_texts, encode):
                tails.setdefault(token, set()).add(tail)
        single, heads = torch.zeros(V, dtype=torch.bool), torch.zeros(V, dtype=torch.bool)
        for token, found in tails.items():
            heads[token] = True
            single[token] = () in found
        return cls(single, heads, {t: tuple(sorted(f, key=len)) for t, f in tails.items()})

    def repeat_limit(self, context: list[int]) -> int:
        """How far back from the end a repeat may reach: up to the most recent breaker (llama.cpp's
        rep_limit), else the whole `context`."""
        if not context:
            return 0
        hits = torch.nonzero(self.heads[torch.tensor(context)]).flatten().tolist()
        n = len(context)
        for position in reversed(hits):
            back = n - 1 - position  # tokens after the head
            longest = -1
            for tail in self.tails[context[position]]:
                if longest < len(tail) <= back and tuple(context[position + 1 : position + 1 + len(tail)]) == tail:
                    longest = len(tail)
            if longest >= 0:
                return back - longest
        return n


def _overlaps(breaker: str, token_texts: Sequence[str], encode: Callable[[str], list[int]]):
    """(token, tail) pairs: tokens holding `breaker` (tail ()), and tokens ending with a prefix of it
    followed by the tokens of the rest (llama.cpp's get_overlapping_token_sequences)."""
    for token, text in enumerate(token_texts):
        if breaker in text:
            yield token, ()
            continue
        position = text.find(breaker[0])
        while position != -1:
            matched = 1
            while matched < len(breaker) and position + matched < len(text):
                if text[position + matched] != breaker[matched]:
                    break
                matched += 1
            else:
                yield token, tuple(encode(breaker[matched:])[:MAX_TAIL_TOKENS])
            position = text.find(breaker[0], position + 1)


def repeat_lengths(context: torch.Tensor, lengths: torch.Tensor, limit: torch.Tensor) -> torch.Tensor:
    """context (R, N) int64, each row's tokens right-aligned after -1 padding; lengths (R,) real
    tokens per row; limit (R,) caps -> (R, N - 1): at column j, how many tokens ending at j equal
    the tokens ending at the row's last one (its longest common suffix with the row), at most limit."""
    R, N = context.shape
    out = torch.zeros(R, N - 1, dtype=torch.int64, device=context.device)
    alive = torch.ones(R, N - 1, dtype=torch.bool, device=context.device)
    for t in range(min(int(limit.max()), N - 1)):
        reference = context[:, N - 1 - t]  # (R,) t tokens before the last
        usable = (t < lengths) & (t < limit)  # (R,)
        alive[:, :t] = False  # j - t would leave the row
        alive[:, t:] &= (context[:, : N - 1 - t] == reference[:, None]) & usable[:, None]
        if not alive.any():
            break
        out += alive
    return out


def _max_exponent(base: float) -> int:
    """The exponent past which base^exponent would overflow float32 (0: no clamp, base ~1)."""
    return int(FLOAT_MAX_LOG / math.log(base)) if base > 1.000001 else 0


def _repeat_limits(context: torch.Tensor, windows: list[list[int]], breakers: list[DryBreakers]) -> list[int]:
    """DryBreakers.repeat_limit of each window (`context`: the windows right-aligned), the common
    case at once: where the most recent breaker head is a one-token breaker and nothing longer,
    the limit is the tokens after it."""
    N = context.shape[1]
    limits = [len(w) for w in windows]
    for b in {id(b): b for b in breakers}.values():
        mine = [r for r, other in enumerate(breakers) if other is b]
        ids = context[mine].cpu()
        hit = (ids >= 0) & b.heads[ids.clamp(min=0)]  # (R', N)
        last = torch.where(hit.any(-1), N - 1 - hit.flip(-1).int().argmax(-1), -1)  # column of the last head
        simple = b.only_single[ids.gather(1, last.clamp(min=0)[:, None])[:, 0]]
        for r, column, is_simple in zip(mine, last.tolist(), simple.tolist()):
            if column >= 0:
                limits[r] = N - 1 - column if is_simple else b.repeat_limit(windows[r])
    return limits


def dry_penalties(
    history: torch.Tensor, rows: list[list[int]], params: list, breakers: list[DryBreakers], vocab: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The DRY penalties of a batch, sparse: (positions (U,) row * vocab + token in the flattened
    (B, V) logits, penalties (U,) float32 to subtract there). `rows[i]`: row i's context (prompt +
    output), `history[i]` the same right-aligned after -1 padding (R, L), `params[i]` its
    SamplingParams, `breakers[i]` its breakers in token form."""
    device = history.device
    windows, live = [], []
    for i, (ids, p) in enumerate(zip(rows, params)):
        window = ids if p.dry_penalty_last_n < 0 else ids[-p.dry_penalty_last_n :]
        if len(window) > p.dry_allowed_length:
            windows.append(window)
            live.append(i)
    nothing = torch.zeros(0, dtype=torch.int64, device=device), torch.zeros(0, device=device)
    if not live:
        return nothing
    N = max(len(w) for w in windows)
    context = history[live, history.shape[1] - N :]  # (R, N) the windows' columns
    context = context.masked_fill(~last_columns(context, torch.tensor([len(w) for w in windows], device=device)), -1)
    limits = _repeat_limits(context, windows, [breakers[i] for i in live])
    keep = [r for r, i in enumerate(live) if limits[r] >= params[i].dry_allowed_length]
    if not keep:
        return nothing
    lengths = [len(windows[r]) for r in keep]
    limits = [
        min(limits[r], params[live[r]].dry_allowed_length + _max_exponent(params[live[r]].dry_base)) for r in keep
    ]  # longer repeats: the same penalty
    live, context = [live[r] for r in keep], context[keep][:, context.shape[1] - max(lengths) :]
    found = repeat_lengths(context, torch.tensor(lengths, device=device), torch.tensor(limits, device=device))
    ps = [params[i] for i in live]
    allowed = torch.tensor([p.dry_allowed_length for p in ps], device=device)[:, None]
    base = torch.tensor([p.dry_base for p in ps], device=device)[:, None]
    multiplier = torch.tensor([p.dry_multiplier for p in ps], device=device)[:, None]
    r, j = (found >= allowed).nonzero(as_tuple=True)  # positions j extending a repeat
    tokens = context[r, j + 1]  # the token after each
    values = multiplier[r, 0] * base[r, 0] ** (found[r, j] - allowed[r, 0]).float()
    breaking = torch.zeros_like(tokens, dtype=torch.bool)
    for b in {id(breakers[i]): breakers[i] for i in live}.values():
        mine = torch.tensor([breakers[i] is b for i in live], device=device)[r]
        breaking |= mine & b.single.to(device)[tokens]
    penalized = ~breaking  # one-token breakers: never penalized
    flat = torch.tensor(live, device=device)[r[penalized]] * vocab + tokens[penalized]
    positions, inverse = torch.unique(flat, return_inverse=True)
    penalties = torch.zeros(len(positions), device=device).scatter_reduce(0, inverse, values[penalized], "amax")
    return positions, penalties
