"""Per-step token masks for the constrained rows of a batch, computed while the model runs."""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    import llguidance


class MaskStep:
    """Start: masks for `matchers` (one per constrained row) on llguidance's threads.
    apply(): wait for them and set disallowed tokens' logits to -inf in those rows."""

    _pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenloom-masks")
    _executor: llguidance.LLExecutor | None = None

    def __init__(self, matchers: list[llguidance.LLMatcher], vocab_size: int) -> None:
        import llguidance  # here, not at import: ~0.8 s and ~100 MB that unconstrained runs never need
        import llguidance.torch as llg_torch
        if MaskStep._executor is None:
            MaskStep._executor = llguidance.LLExecutor()
        self.bitmask = llg_torch.allocate_token_bitmask(len(matchers), vocab_size)      # (rows, vocab/32) int32
        pairs = [(m, i) for i, m in enumerate(matchers)]
        self._done: Future = self._pool.submit(llg_torch.fill_next_token_bitmask_par, self._executor, pairs,
                                               self.bitmask)

    def apply(self, logits: torch.Tensor, rows: list[int], which: list[int]) -> None:
        """logits (B, vocab): mask rows[i] with matcher which[i]'s allowed set (in place)."""
        import llguidance.torch as llg_torch
        self._done.result()
        sub = logits[rows]
        llg_torch.apply_token_bitmask_inplace(sub, self.bitmask[which].to(logits.device))
        logits[rows] = sub
