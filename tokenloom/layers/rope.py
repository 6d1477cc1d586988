"""Rotary position embedding: inverse frequencies with every supported scaling (linear, llama3,
YaRN, dynamic NTK, LongRoPE), cos/sin tables, and their application to q and k.

Matches HF transformers' arithmetic (op order and the float32 upcasts): parity with transformers
is tested to 1e-4 in logprobs.
"""

from __future__ import annotations

import math

import torch

from tokenloom.layers import fused
from tokenloom.models.config import RopeConfig


def rope_inv_freq(rope: RopeConfig, rotary_dim: int, context_len: int | None = None) -> torch.Tensor:
    """Inverse frequencies (rotary_dim/2,) float32, with the configured scaling applied.

    The context-dependent scalings are fixed by the context the engine runs at, so a
    position's rotation never depends on the batch or the step (llama.cpp and vLLM do the
    same): longrope takes its long factors where `context_len` exceeds the original length;
    dynamic stretches the base for `context_len` past max_position_embeddings (unchanged
    within it, where it equals transformers' at every step)."""
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64, device="cpu").float() / rotary_dim  # not meta
    if rope.rope_type == "longrope":
        long = context_len is not None and context_len > rope.original_max_position_embeddings
        factors = torch.tensor(rope.long_factor if long else rope.short_factor, dtype=torch.float32, device="cpu")
        if factors.numel() != rotary_dim // 2:
            raise ValueError(f"longrope has {factors.numel()} factors; rotary dim {rotary_dim} needs {rotary_dim // 2}")
        return 1.0 / (factors * rope.theta**exponents)
    if rope.rope_type == "dynamic":
        original = rope.original_max_position_embeddings
        seq_len = max(context_len or original, original)
        base = rope.theta * ((rope.factor * seq_len / original) - (rope.factor - 1)) ** (rotary_dim / (rotary_dim - 2))
        return 1.0 / (base**exponents)
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type == "llama3":
        return _llama3_scale(inv_freq, rope)
    if rope.rope_type == "yarn":
        return _yarn_inv_freq(rope, rotary_dim)
    return inv_freq


def rope_attention_factor(rope: RopeConfig) -> float:
    """What cos and sin are multiplied by (yarn's and longrope's attention factor; 1 otherwise)."""
    if rope.rope_type not in ("yarn", "longrope"):
        return 1.0
    if rope.attention_factor is not None:
        return rope.attention_factor
    if rope.rope_type == "longrope":
        return (
            1.0
            if rope.factor <= 1
            else math.sqrt(1 + math.log(rope.factor) / math.log(rope.original_max_position_embeddings))
        )

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if rope.mscale and rope.mscale_all_dim:
        return float(mscale(rope.factor, rope.mscale) / mscale(rope.factor, rope.mscale_all_dim))
    return mscale(rope.factor)


def _yarn_inv_freq(rope: RopeConfig, dim: int) -> torch.Tensor:
    """YaRN: interpolated frequencies below the correction range, original ones above, a linear
    ramp between (transformers' _compute_yarn_parameters, the same float32 steps)."""
    base, factor = rope.theta, rope.factor
    beta_fast, beta_slow = rope.beta_fast or 32, rope.beta_slow or 1

    def correction_dim(rotations: float) -> float:
        turns = rope.original_max_position_embeddings / (rotations * 2 * math.pi)
        return (dim * math.log(turns)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2, device="cpu").to(dtype=torch.float) / dim)
    extrapolation = 1 - ramp
    return (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


def _llama3_scale(inv_freq: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    """Llama 3.1 frequency-dependent scaling: long wavelengths slowed by `factor`, smooth band between."""
    old_len = rope.original_max_position_embeddings
    low_freq_wavelen = old_len / rope.low_freq_factor
    high_freq_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rope_cos_sin(
    inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype, scale: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables for `positions` (T,) -> each (T, 1, rotary_dim), times `scale` (yarn's
    attention factor) in float32, cast to `dtype`."""
    freqs = positions.float()[:, None] * inv_freq[None, :]  # (T, rotary_dim/2)
    emb = torch.cat((freqs, freqs), dim=-1)  # (T, rotary_dim)
    cos, sin = emb.cos(), emb.sin()
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    return cos.to(dtype)[:, None, :], sin.to(dtype)[:, None, :]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE: x (T, heads, head_dim), cos/sin (T, 1, rotary_dim); dims past
    rotary_dim (partial rotary, e.g. Phi-4-mini) pass through unturned."""
    if (
        x.stride(2) == 1
        and x.stride(1) == x.shape[2]
        and cos.is_contiguous()
        and sin.is_contiguous()
        and fused.enabled(x)
    ):
        return fused.rope(x, cos, sin)  # partial rotary too: the same arithmetic per dim
    rotary = cos.shape[-1]
    if rotary < x.shape[-1]:
        return torch.cat([apply_rope(x[..., :rotary], cos, sin), x[..., rotary:]], dim=-1)
    return x * cos + _rotate_half(x) * sin


def interleaved_to_halves(head_dim: int, rotary_dim: int, heads: int) -> torch.Tensor:
    """Row order (heads * head_dim,) that turns each head's interleaved rotary pairs (2i, 2i + 1)
    into rotate-half pairs (i, i + rotary_dim / 2); dims past rotary_dim stay where they are.
    Attention scores depend on q and k only through their dot products, so q and k read in this
    order and turned rotate-half give the interleaved rope's scores exactly."""
    # on the CPU: models are built under torch.device("meta"), and an index is read, not loaded
    cpu = torch.device("cpu")
    halves = [torch.arange(0, rotary_dim, 2, device=cpu), torch.arange(1, rotary_dim, 2, device=cpu)]
    one = torch.cat([*halves, torch.arange(rotary_dim, head_dim, device=cpu)])
    return torch.cat([one + h * head_dim for h in range(heads)])
