"""Mamba-2's mixer (Granite 4.0-H's recurrent layers; ModelConfig.recurrent says the shapes), in
place of attention in its layers, with the attention op's call signature: ``forward(x, attend,
layer)``; the step's metadata and the per-sequence state come through `attend`.

    [z, xBC, dt] = in_proj(x)
    xBC = silu(causal_conv(xBC))            -> x (heads, head_dim), B, C (groups, state_size)
    dt = clamp(softplus(dt + dt_bias))      A = -exp(A_log)
    y = ssm(x, dt, A, B, C) + D x           (layers/ssm_scan.py)
    out = out_proj(group_rms_norm(y * silu(z)) * norm.weight)

The parameters keep HF's names (in_proj, conv1d, dt_bias, A_log, D, norm, out_proj).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenloom.attention.backend import StepAttention
from tokenloom.kv_cache.recurrent import RecurrentBatch, recurrent_batch
from tokenloom.layers.causal_conv import CausalConv1d, conv_batch
from tokenloom.layers.ssm_scan import DecayRates, decode_step_takes, ssd_scan, ssm_step_slots
from tokenloom.models.config import MambaConfig, ModelConfig

# positions a prompt's scan takes at once: the scan is exact for any block (layers/ssm_scan.py); a
# block's products grow with its square, the state passed between blocks with their number
SCAN_BLOCK = 128


class GatedGroupRMSNorm(nn.Module):
    """y -> weight * rms_norm_per_group(y * silu(z)): the inner width in `groups` equal groups,
    each normed alone, computed in float32 (transformers' RMSNormGated)."""

    def __init__(self, dim: int, groups: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.groups, self.eps = groups, eps

    def forward(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """y (T, dim) float32, z (T, dim) -> (T, dim) in z's dtype."""
        T, dim = y.shape
        g = (y * F.silu(z.float())).view(T, self.groups, dim // self.groups)
        g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * g.view(T, dim).to(z.dtype)


class Mamba2Mixer(DecayRates, nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        m = cfg.recurrent
        assert isinstance(m, MambaConfig)  # the layers ModelConfig.recurrent names
        self.m = m
        self.in_proj = nn.Linear(cfg.hidden_size, m.inner_size + m.conv_dim + m.num_heads, bias=m.proj_bias)
        self.conv1d = CausalConv1d(m.conv_dim, m.conv_kernel, m.conv_bias)
        self.dt_bias = nn.Parameter(torch.empty(m.num_heads))
        self.A_log = nn.Parameter(torch.empty(m.num_heads))
        self.D = nn.Parameter(torch.empty(m.num_heads))
        self.norm = GatedGroupRMSNorm(m.inner_size, m.n_groups, cfg.norm_eps)
        self.out_proj = nn.Linear(m.inner_size, cfg.hidden_size, bias=m.proj_bias)

    def forward(self, x: torch.Tensor, attend: StepAttention, layer: int) -> torch.Tensor:
        """x (T, hidden) -> (T, hidden); advances each sequence's state in layer `layer`. A step
        where every sequence decodes runs everything between in_proj and out_proj as one compiled
        CPU call where it builds (layers/csrc/mamba_step_cpu.cpp mamba_decode: the same steps)."""
        m, states = self.m, attend.kv_cache.states
        batch = recurrent_batch(attend.meta, x.device)
        zxbcdt = self.in_proj.forward(x)  # (T, inner + conv_dim + heads)
        conv_states, ssm_states = states.conv[layer], states.state[layer]
        if batch.all_decode and decode_step_takes((zxbcdt,), conv_states, self.dt_bias):
            y = torch.ops.tokenloom_ssm.mamba_decode(
                zxbcdt,
                conv_states,
                ssm_states,
                batch.decode_slots,
                batch.decode_keep.reshape(-1),
                self.conv1d.weight,
                self.conv1d.bias,
                self.dt_bias,
                self._decay_rates(),
                self.D,
                self.norm.weight,
                m.n_groups,
                self.norm.eps,
                *m.time_step_limit,
            )
            return self.out_proj.forward(y)
        z, xbc, dt = zxbcdt.split([m.inner_size, m.conv_dim, m.num_heads], dim=-1)
        xbc = F.silu(conv_batch(self.conv1d, xbc, batch, conv_states))  # (T, conv_dim)
        xs, B, C = xbc.float().split([m.inner_size, m.n_groups * m.state_size, m.n_groups * m.state_size], dim=-1)
        T = x.shape[0]
        xs = xs.view(T, m.num_heads, m.head_dim)
        B, C = B.view(T, m.n_groups, m.state_size), C.view(T, m.n_groups, m.state_size)
        dt = F.softplus(dt.float() + self.dt_bias.float()).clamp(*m.time_step_limit)  # (T, heads)
        y = self._scan(xs, dt, self._decay_rates(), B, C, batch, ssm_states)  # (T, heads, head_dim)
        y = y + self.D.float()[:, None] * xs
        return self.out_proj.forward(self.norm(y.view(T, m.inner_size), z))

    def _scan(self, xs, dt, A, B, C, batch: RecurrentBatch, states: torch.Tensor) -> torch.Tensor:
        """The SSM over each sequence's rows: xs (T, heads, head_dim), dt (T, heads), B and C
        (T, groups, N) -> y (T, heads, head_dim) float32."""
        keep, slots = batch.decode_keep, batch.decode_slots
        if batch.all_decode:
            return ssm_step_slots(states, slots, keep, xs, dt, A, B, C)
        y = torch.empty_like(xs)
        if batch.decode_rows:
            rows = batch.decode_rows
            y[rows] = ssm_step_slots(states, slots, keep, xs[rows], dt[rows], A, B[rows], C[rows])
        for start, n, slot, fresh in batch.prompts:
            r = slice(start, start + n)
            y[r], states[slot] = ssd_scan(xs[r], dt[r], A, B[r], C[r], None if fresh else states[slot], SCAN_BLOCK)
        return y
