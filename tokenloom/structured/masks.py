"""Per-step token masks for the constrained rows of a batch, computed while the model runs."""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # imported by the first constrained step: a plain run never loads llguidance
    import llguidance


class MaskStep:
    """Start: masks for `matchers` (one per constrained row) on llguidance's threads.
    apply(): wait for them and set disallowed tokens' logits to -inf in those rows.

    llguidance.torch is not used: importing it compiles nothing but imports torch._dynamo and
    inductor for its ``torch.compile`` decorator (holding the GIL throughout: a server's event
    loop froze that long at its first constrained request), and its compiled kernel would compile
    on the first step. The bit unpacking below is a few torch ops."""

    _pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenloom-masks")
    _executor: llguidance.LLExecutor | None = None

    def __init__(self, matchers: list[llguidance.LLMatcher], vocab_size: int) -> None:
        if MaskStep._executor is None:
            import llguidance

            MaskStep._executor = llguidance.LLExecutor()
        words = (vocab_size + 31) // 32
        self.bitmask = torch.full((len(matchers), words), -1, dtype=torch.int32)  # (rows, vocab/32): bit = allowed
        pairs = [(m, i) for i, m in enumerate(matchers)]
        self._done: Future = self._pool.submit(
            MaskStep._executor.unsafe_compute_mask_ptr, pairs, self.bitmask.data_ptr(), words * 4, len(matchers)
        )

    def apply(self, logits: torch.Tensor, rows: list[int], which: list[int]) -> None:
        """logits (B, vocab): mask rows[i] with matcher which[i]'s allowed set (in place)."""
        self._done.result()
        sub = logits[rows]
        apply_bitmask(sub, self.bitmask[which].to(logits.device))
        logits[rows] = sub


def apply_bitmask(logits: torch.Tensor, mask: torch.Tensor) -> None:
    """logits (R, V): -inf where `mask` (R, W) int32 has bit v % 32 of word v // 32 clear, and past
    its 32 W tokens (in place)."""
    r, v = logits.shape
    covered = min(v, 32 * mask.shape[1])
    shifts = torch.arange(32, dtype=torch.int32, device=mask.device)
    allowed = ((mask.unsqueeze(-1) >> shifts) & 1).view(r, -1)[:, :covered]  # (R, covered)
    logits[:, :covered].masked_fill_(allowed == 0, float("-inf"))
    logits[:, covered:] = float("-inf")
