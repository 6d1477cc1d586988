"""HF transformers as the oracle: a plain greedy loop over its own KV cache.

No generate() logits processors are involved (min_new_tokens would mask EOS and
change the argmax), so the reference is exactly "argmax of HF's logits".
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Reference:
    tokens: list[int]
    logprobs: list[float]    # chosen-token logprobs
    margins: list[float]     # top1 - top2 logit per step


@torch.no_grad()
def hf_greedy(model, prompt: list[int], new_tokens: int) -> Reference:
    device = next(model.parameters()).device
    out = model(torch.tensor([prompt], device=device), use_cache=True)
    tokens, logprobs, margins = [], [], []
    for _ in range(new_tokens):
        logits = out.logits[0, -1].float()                   # (vocab,)
        token = int(logits.argmax())
        top2 = logits.topk(2).values
        tokens.append(token)
        logprobs.append(float(logits.log_softmax(-1)[token]))
        margins.append(float(top2[0] - top2[1]))
        out = model(torch.tensor([[token]], device=device), past_key_values=out.past_key_values, use_cache=True)
    return Reference(tokens, logprobs, margins)
