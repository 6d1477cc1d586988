"""Gated DeltaNet (Qwen3-Next's recurrent layers; ModelConfig.recurrent, a DeltaNetConfig, says
the shapes), in place of attention in its layers, with the attention op's call signature:
``forward(x, attend, layer)``; the step's metadata and the per-sequence state come through `attend`.

    [q, k, v, z] = in_proj(x)               [b, a] = in_proj_ba(x)
    [q, k, v] = silu(causal_conv([q, k, v]))
    q, k = l2_norm(q), l2_norm(k)           each key head serving num_v / num_k value heads
    beta = sigmoid(b)                       g = -exp(A_log) softplus(a + dt_bias)
    o = delta_rule(q / sqrt(k_dim), k, v, g, beta)      (layers/delta_rule.py)
    out = out_proj(rms_norm_per_head(o) * norm.weight * silu(z))

in_proj holds HF's in_proj_qkvz, its rows re-ordered at load from HF's per-key-head groups ([q, k,
v, z] of key head 0, then of key head 1, ...) to [q | k | v | z] (each in head order), as llama.cpp's
converter re-orders them (``qkvz_rows``); in_proj_ba's rows likewise to [b | a] (``ba_rows``). The
two stay apart: a GGUF file may store the small in_proj_ba as float beside blocks of the others.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenloom.attention.backend import StepAttention
from tokenloom.kv_cache.recurrent import RecurrentBatch, recurrent_batch
from tokenloom.layers.causal_conv import CausalConv1d, conv_batch
from tokenloom.layers.delta_rule import delta_chunked, delta_step_slots
from tokenloom.layers.ssm_scan import DecayRates, decode_step_takes
from tokenloom.models.config import DeltaNetConfig, ModelConfig

# positions a prompt's chunked delta rule takes at once: exact for any block (layers/delta_rule.py);
# a block's triangular solve grows with its square, the sequential state passes with their number
DELTA_BLOCK = 64
L2_EPS = 1e-6  # transformers' (and the FLA library's) l2norm epsilon


class GatedHeadRMSNorm(nn.Module):
    """o -> weight * rms_norm_per_head(o) * silu(z), computed in float32 (transformers'
    Qwen3NextRMSNormGated: the norm before the gate, unlike Mamba-2's)."""

    def __init__(self, head_dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(head_dim))
        self.eps = eps

    def forward(self, o: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """o (T, heads, head_dim) float32, z (T, heads * head_dim) -> (T, heads * head_dim) in z's dtype."""
        normed = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + self.eps)
        gated = (self.weight.float() * normed).flatten(1) * F.silu(z.float())
        return gated.to(z.dtype)


def qkvz_rows(cfg: DeltaNetConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows of [q | k | v], rows of z) in HF's in_proj_qkvz, whose rows are grouped per key head
    ([q, k, v, z] of key head 0, then of key head 1, ...)."""
    r = cfg.num_v_heads // cfg.num_k_heads
    sizes = [cfg.k_head_dim, cfg.k_head_dim, r * cfg.v_head_dim, r * cfg.v_head_dim]
    grouped = torch.arange(cfg.num_k_heads * sum(sizes), device="cpu").view(cfg.num_k_heads, sum(sizes))
    q, k, v, z = (rows.reshape(-1) for rows in grouped.split(sizes, dim=1))
    return torch.cat([q, k, v]), z


def ba_rows(cfg: DeltaNetConfig) -> torch.Tensor:
    """The rows of HF's in_proj_ba (per key head [b of its value heads, a of them]) as [b | a]."""
    r = cfg.num_v_heads // cfg.num_k_heads
    grouped = torch.arange(2 * cfg.num_v_heads, device="cpu").view(cfg.num_k_heads, 2, r)
    return torch.cat([grouped[:, 0].reshape(-1), grouped[:, 1].reshape(-1)])


class GatedDeltaNet(DecayRates, nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        d = cfg.recurrent
        assert isinstance(d, DeltaNetConfig)  # the layers ModelConfig.recurrent names
        self.d = d
        self.in_proj = nn.Linear(cfg.hidden_size, d.conv_dim + d.value_dim, bias=False)
        self.in_proj_ba = nn.Linear(cfg.hidden_size, 2 * d.num_v_heads, bias=False)
        self.conv1d = CausalConv1d(d.conv_dim, d.conv_kernel, bias=False)
        self.dt_bias = nn.Parameter(torch.empty(d.num_v_heads))
        self.A_log = nn.Parameter(torch.empty(d.num_v_heads))
        self.norm = GatedHeadRMSNorm(d.v_head_dim, cfg.norm_eps)
        self.out_proj = nn.Linear(d.value_dim, cfg.hidden_size, bias=False)

    def shard_rows(self, shard: str) -> slice:
        """in_proj's rows for a checkpoint part: "qkv" or "z"."""
        d = self.d
        return slice(0, d.conv_dim) if shard == "qkv" else slice(d.conv_dim, d.conv_dim + d.value_dim)

    def forward(self, x: torch.Tensor, attend: StepAttention, layer: int) -> torch.Tensor:
        """x (T, hidden) -> (T, hidden); advances each sequence's state in layer `layer`. A step
        where every sequence decodes runs everything between the input projections and out_proj
        as one compiled CPU call where it builds (layers/csrc/mamba_step_cpu.cpp deltanet_decode:
        the same steps)."""
        d, states = self.d, attend.kv_cache.states
        batch = recurrent_batch(attend.meta, x.device)
        T = x.shape[0]
        qkvz, ba = self.in_proj.forward(x), self.in_proj_ba.forward(x)
        conv_states, delta_states = states.conv[layer], states.state[layer]
        compiled = batch.all_decode and self.d.v_head_dim <= 256  # the kernel's per-head buffers
        if compiled and decode_step_takes((qkvz, ba), conv_states, self.dt_bias):
            o = torch.ops.tokenloom_ssm.deltanet_decode(
                qkvz,
                ba,
                conv_states,
                delta_states,
                batch.decode_slots,
                batch.decode_keep.reshape(-1),
                self.conv1d.weight,
                self.dt_bias,
                self._decay_rates(),
                self.norm.weight,
                d.num_k_heads,
                self.norm.eps,
            )
            return self.out_proj.forward(o)
        qkv, z = qkvz.split([d.conv_dim, d.value_dim], dim=-1)
        b, a = ba.split(d.num_v_heads, dim=-1)
        qkv = F.silu(conv_batch(self.conv1d, qkv, batch, conv_states))  # (T, conv_dim)
        q, k, v = qkv.float().split([d.key_dim, d.key_dim, d.value_dim], dim=-1)
        q, k = (self._heads(t.reshape(T, d.num_k_heads, d.k_head_dim)) for t in (q, k))  # (T, Hv, dk)
        q = q * d.k_head_dim**-0.5
        v = v.reshape(T, d.num_v_heads, d.v_head_dim)
        beta = torch.sigmoid(b.float())  # (T, Hv)
        g = self._decay_rates() * F.softplus(a.float() + self.dt_bias.float())  # (T, Hv) log decay <= 0
        o = self._scan(q, k, v, g, beta, batch, delta_states)  # (T, Hv, dv)
        return self.out_proj.forward(self.norm(o, z))

    def _heads(self, t: torch.Tensor) -> torch.Tensor:
        """(T, Hk, dk) -> L2-normed (T, Hv, dk), each key head repeated for its value heads."""
        t = t * torch.rsqrt(t.pow(2).sum(-1, keepdim=True) + L2_EPS)
        r = self.d.num_v_heads // self.d.num_k_heads
        return t if r == 1 else t.repeat_interleave(r, dim=1)

    def _scan(self, q, k, v, g, beta, batch: RecurrentBatch, states: torch.Tensor) -> torch.Tensor:
        """The delta rule over each sequence's rows -> o (T, Hv, dv) float32."""
        keep, slots = batch.decode_keep, batch.decode_slots
        if batch.all_decode:
            return delta_step_slots(states, slots, keep, q, k, v, g, beta)
        o = q.new_empty(*v.shape)
        if batch.decode_rows:
            r = batch.decode_rows
            o[r] = delta_step_slots(states, slots, keep, q[r], k[r], v[r], g[r], beta[r])
        for start, n, slot, fresh in batch.prompts:
            s = slice(start, start + n)
            o[s], states[slot] = delta_chunked(
                q[s], k[s], v[s], g[s], beta[s], None if fresh else states[slot], DELTA_BLOCK
            )
        return o
