"""How close a model as loaded stays to a reference load of the same weights (e.g. GGUF blocks
with int8 activations against the file dequantized to float32), teacher-forced on a text:
the share of positions whose top-1 token is the same, and the mean KL divergence
KL(reference || model), llama.cpp's ``llama-perplexity --kl-divergence`` figures."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Agreement:
    same_top1: float  # share of scored positions, 0..1
    kl_mean: float  # nats per position
    kl_p99: float
    positions: int


def compare_logits(reference: torch.Tensor, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per position of two (T, vocab) logit rows of the same text: whether the top-1 tokens
    agree (T,) bool, and KL(reference || logits) in nats (T,), computed in float32."""
    lr, lm = reference.float().log_softmax(-1), logits.float().log_softmax(-1)
    return lr.argmax(-1) == lm.argmax(-1), (lr.exp() * (lr - lm)).sum(-1)


def whole_windows(token_ids: list[int], window: int) -> list[int]:
    """The tokens llama-perplexity would score: as many whole windows of `window` as fit (its
    chunks; a partial last one is dropped), or all of them where not even one window fits."""
    whole = len(token_ids) // window * window
    return token_ids[:whole] if whole else token_ids


@torch.inference_mode()
def agreement(engine, reference, token_ids: list[int], window: int = 512, skip: int = 0) -> Agreement:
    """Compare `engine` with `reference` (both idle engines with the same tokenizer) over
    non-overlapping windows of `window` tokens, each predicted from its window's earlier tokens;
    the first `skip` positions of each window are context only (llama-perplexity scores the
    second half of each window: skip = window // 2)."""
    if window < 2 or not 0 <= skip < window - 1:
        raise ValueError(f"need window >= 2 and 0 <= skip < window - 1, got window {window}, skip {skip}")
    same, kls = 0, []
    for start in range(0, len(token_ids) - 1, window):
        piece = token_ids[start : start + window]
        if len(piece) < 2:
            break
        for (at, a), (_, b) in zip(engine.prefill_logits(piece), reference.prefill_logits(piece)):
            rows = slice(max(0, skip - at), len(piece) - 1 - at)  # the last token predicts past the window
            top1, kl = compare_logits(b[rows], a[rows])
            same += int(top1.sum())
            kls.append(kl)
    kl = torch.cat(kls) if kls else torch.empty(0)
    if kl.numel() == 0:
        raise ValueError("the text is too short: no position was scored")
    return Agreement(same / kl.numel(), kl.mean().item(), kl.quantile(0.99).item(), kl.numel())
