"""A causal depthwise conv over each sequence's tokens, with its last inputs kept as state
(Mamba-2's and Gated DeltaNet's short conv before the scan).

Channel c of output t is bias[c] + sum_k weight[c, 0, k] x[t - K + 1 + k, c] over the K taps,
where positions before the sequence's first token read as zero. A sequence's state is its last
K - 1 inputs (channels x K - 1), so a chunk continues exactly where the previous one ended.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from tokenloom.kv_cache.recurrent import RecurrentBatch


class CausalConv1d(nn.Module):
    """weight (channels, 1, K) and bias (channels,) as HF's nn.Conv1d(groups=channels) stores them."""

    def __init__(self, channels: int, kernel: int, bias: bool = True) -> None:
        super().__init__()
        self.channels, self.kernel = channels, kernel
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel))
        self.bias = nn.Parameter(torch.empty(channels)) if bias else None

    def prompt(self, x: torch.Tensor, state: torch.Tensor, fresh: bool) -> torch.Tensor:
        """One sequence's chunk x (L, channels) after the inputs `state` (channels, K - 1) holds
        (zeros where `fresh`) -> (L, channels); `state` takes the chunk's last K - 1 inputs (in place)."""
        before = torch.zeros_like(state) if fresh else state
        window = torch.cat([before, x.t().to(state.dtype)], dim=1)  # (channels, K - 1 + L)
        out = F.conv1d(window[None], self.weight, self.bias, groups=self.channels)[0]  # (channels, L)
        state.copy_(window[:, window.shape[1] - state.shape[1] :])
        return out.t()

    def step(self, x: torch.Tensor, states: torch.Tensor, slots: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        """One token of each of S sequences: x (S, channels), their states rows `slots` (S,) of
        `states` (slots, channels, K - 1), `keep` (S, 1) 0 where a sequence starts from zero ->
        (S, channels); each state shifted by its token (in place). On the CPU in float32 one
        compiled call (csrc/mamba_step_cpu.cpp), the same sums tap by tap."""
        if self._kernel_takes(states, x):
            return torch.ops.tokenloom_ssm.conv_step(states, slots, keep.reshape(-1), x, self.weight, self.bias)
        before = states.index_select(0, slots) * keep[..., None].to(states.dtype)  # (S, channels, K - 1)
        window = torch.cat([before, x[..., None].to(states.dtype)], dim=2)  # (S, channels, K)
        out = (window * self.weight[:, 0]).sum(-1)  # (S, channels)
        if self.bias is not None:
            out = out + self.bias
        states.index_copy_(0, slots, window[..., 1:])
        return out

    def _kernel_takes(self, states: torch.Tensor, x: torch.Tensor) -> bool:
        from tokenloom.layers import ssm_scan  # the compiled library holds both decode steps

        return (
            states.device.type == "cpu"
            and states.dtype == x.dtype == self.weight.dtype == torch.float32
            and states.is_contiguous()
            and x.stride(-1) == 1
            and ssm_scan.build()
        )


def conv_batch(conv: CausalConv1d, x: torch.Tensor, batch: RecurrentBatch, states: torch.Tensor) -> torch.Tensor:
    """The causal conv over each sequence's rows of a step's x (T, channels) -> (T, channels) in x's
    dtype: the decoding sequences' one token each in one call, each prompt chunk alone; `states`
    (slots, channels, K - 1) advanced in place."""
    if batch.all_decode:
        return conv.step(x, states, batch.decode_slots, batch.decode_keep).to(x.dtype)
    out = torch.empty_like(x)
    if batch.decode_rows:
        rows = batch.decode_rows
        out[rows] = conv.step(x[rows], states, batch.decode_slots, batch.decode_keep).to(x.dtype)
    for start, n, slot, fresh in batch.prompts:
        out[start : start + n] = conv.prompt(x[start : start + n], states[slot], fresh).to(x.dtype)
    return out
