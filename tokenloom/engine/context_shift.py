"""Context shift: generation that goes on past the context in bounded memory, as llama.cpp does.

When a decoding sequence fills the context (``max_model_len`` tokens), it keeps its first
``keep`` tokens (the BOS / system prompt, and attention sinks: the first tokens draw a large
share of attention, and dropping them derails a model), rounded up to whole KV blocks, and drops
the oldest whole blocks after them: half of the rest, as llama.cpp's ``n_discard`` does. The
blocks after the dropped ones move up in its block table, and their keys are turned back by the
dropped length: with rotary positions, ``rope(k, p - d)`` is ``rope(k, p)`` turned by ``-d``, so
no token is recomputed (``PagedKVCache.shift_keys``). Values carry no position and stay as they are.

What the model sees afterwards is the kept tokens at positions ``0..keep-1`` and the rest at
``keep..``, their keys and values as computed when the dropped tokens were still there (as in
llama.cpp; a fresh prefill of the same tokens differs from layer 2 on, since each layer's keys
depend on what the layers below attended to).

Where it applies: models whose every attention layer has rotary positions (or none), one process,
no speculative decoding; hybrids (a recurrent state cannot forget tokens), latent attention
(DeepSeek) and GPT-2's learned positions are refused with an error naming the model.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ShiftPlan:
    """One shift of one sequence, in whole blocks: ``keep_blocks`` stay, the next
    ``drop_blocks`` go, everything after moves up by ``delta`` positions."""

    keep_blocks: int
    drop_blocks: int
    block_size: int

    @property
    def keep_tokens(self) -> int:
        return self.keep_blocks * self.block_size

    @property
    def delta(self) -> int:
        return self.drop_blocks * self.block_size


def plan_shift(num_computed_tokens: int, keep: int, block_size: int) -> ShiftPlan | None:
    """What to drop from a sequence with `num_computed_tokens` tokens in the cache that keeps its
    first `keep`: half of the full blocks after the kept ones (at least one); None if no full
    block lies after them."""
    keep_blocks = -(-keep // block_size)
    after = num_computed_tokens // block_size - keep_blocks  # full blocks past the kept ones
    if after < 1:
        return None
    return ShiftPlan(keep_blocks, max(1, after // 2), block_size)


def check_keep(keep: int, max_model_len: int, block_size: int) -> None:
    """ValueError unless a context of `max_model_len` keeping `keep` tokens leaves whole blocks to
    drop (the kept blocks and two more must fit)."""
    kept = -(-keep // block_size) * block_size
    if kept + 2 * block_size > max_model_len:
        raise ValueError(
            f"context shift keeps the first {keep} tokens ({kept} in whole blocks of {block_size}), which "
            f"leaves no room to shift a context of {max_model_len}; lower the keep or raise --max-model-len"
        )
