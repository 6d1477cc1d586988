"""The Triton kernels of the CUDA path against torch references, at small shapes.

Without a GPU they run in Triton's interpreter on the CPU (conftest sets TRITON_INTERPRET=1
before triton is imported); on a CUDA machine the same tests run the compiled kernels. Layouts
are the awkward ones: block tables with holes and out of order, GQA groups that are not powers of
two, head dims that are not, windows, prefix hits, chunks of odd lengths, padding rows."""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("triton")

from tokenloom.attention.metadata import build_paged_inputs
from tokenloom.kernels.triton.paged_attention import paged_attention
from tokenloom.kernels.triton.rms_norm import add_rms_norm, rms_norm
from tokenloom.kernels.triton.rope_cache import rope_and_cache
from tokenloom.kernels.triton.silu_mul import silu_mul
from tokenloom.layers.rope import apply_rope, rope_cos_sin, rope_inv_freq

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# The interpreter computes in numpy, which has no bfloat16 (it rounds bf16 its own way): half
# precision is checked there as float16, and as bfloat16 too where the kernels compile.
HALF = [torch.float16, torch.bfloat16] if DEVICE == "cuda" else [torch.float16]


def close(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Equal within one rounding of got's dtype (float32: a few ulps of fused multiply-adds)."""
    tol = dict(atol=1e-6, rtol=1e-6) if got.dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
    return torch.allclose(got.float().cpu(), want.float().cpu(), **tol)


def reference_attention(
    q, k_cache, v_cache, query_lens, context_lens, tables, scale, window=None, softcap=None, sinks=None
):
    """float64 attention of each sequence's queries (the last of its context) over its cache."""
    out = torch.zeros(q.shape, dtype=torch.float64)
    group = q.shape[1] // k_cache.shape[2]
    row = 0
    for q_len, ctx, table in zip(query_lens, context_lens, tables):
        keys = k_cache[table].flatten(0, 1)[:ctx].double().cpu()  # (ctx, kv_heads, D)
        values = v_cache[table].flatten(0, 1)[:ctx].double().cpu()
        keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
        qs = q[row : row + q_len].double().cpu()  # (q_len, heads, D)
        scores = torch.einsum("qhd,khd->hqk", qs, keys) * scale
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        q_pos = torch.arange(ctx - q_len, ctx)[:, None]
        k_pos = torch.arange(ctx)[None, :]
        visible = k_pos <= q_pos
        if window is not None:
            visible &= k_pos > q_pos - window
        scores = scores.masked_fill(~visible, float("-inf"))
        if sinks is not None:
            sink = sinks.double().cpu()[:, None, None].expand(-1, q_len, 1)
            weights = torch.softmax(torch.cat([scores, sink], -1), -1)[..., :-1]
        else:
            weights = torch.softmax(scores, -1)
        out[row : row + q_len] = torch.einsum("hqk,khd->qhd", weights, values)
        row += q_len
    return out


def random_layout(query_lens, context_lens, page, num_blocks, gen):
    """Each sequence's block table: distinct blocks drawn at random (holes, any order)."""
    needed = [math.ceil(c / page) for c in context_lens]
    ids = torch.randperm(num_blocks, generator=gen)[: sum(needed)].tolist()
    tables, at = [], 0
    for n in needed:
        tables.append(ids[at : at + n])
        at += n
    return tables


CASES = {
    "decode_gqa3": dict(query_lens=[1, 1, 1], context_lens=[1, 37, 70], heads=9, kv_heads=3, dim=64),
    "decode_mqa_dim24": dict(query_lens=[1, 1], context_lens=[16, 33], heads=4, kv_heads=1, dim=24),
    "prefill_whole": dict(query_lens=[21, 5], context_lens=[21, 5], heads=4, kv_heads=2, dim=32),
    "prefix_hit_and_decode": dict(query_lens=[1, 19, 3, 1], context_lens=[40, 51, 3, 17], heads=8, kv_heads=2, dim=16),
    "long_chunk": dict(query_lens=[130], context_lens=[150], heads=2, kv_heads=2, dim=32),
}


@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("case", sorted(CASES))
def test_paged_attention_matches_reference(case, window):
    c = CASES[case]
    gen = torch.Generator().manual_seed(hash(case) % 1000)
    page, num_blocks = 16, 40
    tables = random_layout(c["query_lens"], c["context_lens"], page, num_blocks, gen)
    T = sum(c["query_lens"])
    qkv = torch.randn(T, (c["heads"] + 4) * c["dim"], generator=gen)  # q is a strided view
    q = qkv[:, : c["heads"] * c["dim"]].view(T, c["heads"], c["dim"]).to(DEVICE)
    k_cache = torch.randn(num_blocks, page, c["kv_heads"], c["dim"], generator=gen).to(DEVICE)
    v_cache = torch.randn(num_blocks, page, c["kv_heads"], c["dim"], generator=gen).to(DEVICE)
    inputs = build_paged_inputs(c["query_lens"], c["context_lens"], tables, torch.device(DEVICE))
    scale = c["dim"] ** -0.5
    got = paged_attention(q, k_cache, v_cache, inputs, scale, window)
    want = reference_attention(q, k_cache, v_cache, c["query_lens"], c["context_lens"], tables, scale, window)
    assert got.shape == q.shape
    assert torch.allclose(got.double().cpu(), want, atol=1e-5, rtol=1e-4), (got.double().cpu() - want).abs().max()


def test_paged_attention_softcap_and_sinks():
    gen = torch.Generator().manual_seed(1)
    query_lens, context_lens, heads, kv_heads, dim = [1, 6], [20, 6], 4, 2, 32
    tables = random_layout(query_lens, context_lens, 16, 8, gen)
    q = (3 * torch.randn(7, heads, dim, generator=gen)).to(DEVICE)  # scores large enough to cap
    k_cache = torch.randn(8, 16, kv_heads, dim, generator=gen).to(DEVICE)
    v_cache = torch.randn(8, 16, kv_heads, dim, generator=gen).to(DEVICE)
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0]).to(DEVICE)
    inputs = build_paged_inputs(query_lens, context_lens, tables, torch.device(DEVICE))
    for softcap, s in ((3.0, None), (None, sinks), (3.0, sinks)):
        got = paged_attention(q, k_cache, v_cache, inputs, 0.2, None, softcap, s)
        want = reference_attention(q, k_cache, v_cache, query_lens, context_lens, tables, 0.2, None, softcap, s)
        assert torch.allclose(got.double().cpu(), want, atol=1e-5, rtol=1e-4)
    plain = reference_attention(q, k_cache, v_cache, query_lens, context_lens, tables, 0.2)
    capped = reference_attention(q, k_cache, v_cache, query_lens, context_lens, tables, 0.2, None, 3.0)
    assert (plain - capped).abs().max() > 1e-2  # the cap bites at these scores


@pytest.mark.parametrize("dtype", HALF)
def test_paged_attention_padding_rows_are_zero_and_half_precision_is_close(dtype):
    """A sequence with no context (a CUDA graph's padding row) gives zeros, never NaN; half
    precision inputs land within its rounding of the float64 reference."""
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(3, 4, 32, generator=gen).to(DEVICE, dtype)
    k_cache = torch.randn(6, 16, 2, 32, generator=gen).to(DEVICE, dtype)
    v_cache = torch.randn(6, 16, 2, 32, generator=gen).to(DEVICE, dtype)
    inputs = build_paged_inputs([1, 1, 1], [30, 0, 5], [[3, 1], [], [5]], torch.device(DEVICE))
    got = paged_attention(q, k_cache, v_cache, inputs, 0.25)
    assert torch.equal(got[1].float().cpu(), torch.zeros(4, 32))
    want = reference_attention(q[[0, 2]], k_cache, v_cache, [1, 1], [30, 5], [[3, 1], [5]], 0.25)
    both = torch.stack([got[0], got[2]]).double().cpu()
    assert ((both - want).norm() / want.norm()).item() < 1e-2


@pytest.mark.parametrize("rotary", [32, 16])
@pytest.mark.parametrize("dtype", [torch.float32, *HALF])
def test_rope_and_cache_write_match_torch(rotary, dtype):
    gen = torch.Generator().manual_seed(3)
    T, heads, kv_heads, dim, page = 5, 4, 2, 32, 4
    qkv = torch.randn(T, (heads + 2 * kv_heads) * dim, generator=gen).to(DEVICE, dtype)
    positions = torch.tensor([0, 7, 8, 30, 31])
    from tokenloom.models.config import RopeConfig

    cos, sin = rope_cos_sin(rope_inv_freq(RopeConfig(theta=10000.0), rotary), positions, dtype)
    k_cache = torch.zeros(6, page, kv_heads, dim, dtype=dtype).to(DEVICE)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.tensor([9, 0, 23, -1, 13]).to(DEVICE)  # -1: written nowhere
    ref = qkv.clone().cpu()
    q = rope_and_cache(qkv, (cos.to(DEVICE), sin.to(DEVICE)), k_cache, v_cache, slots, heads, kv_heads, dim)
    qk = apply_rope(ref[:, : (heads + kv_heads) * dim].view(T, heads + kv_heads, dim), cos, sin)
    assert close(q, qk[:, :heads])
    assert not torch.equal(qk, ref[:, : (heads + kv_heads) * dim].view(T, heads + kv_heads, dim))  # it turned
    flat_k = k_cache.cpu().view(-1, kv_heads, dim)
    flat_v = v_cache.cpu().view(-1, kv_heads, dim)
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            assert close(flat_k[slot], qk[t, heads:])
            assert torch.equal(flat_v[slot], ref[t, (heads + kv_heads) * dim :].view(kv_heads, dim))
    written = {s for s in slots.tolist() if s >= 0}
    untouched = [s for s in range(flat_k.shape[0]) if s not in written]
    assert not flat_k[untouched].any() and not flat_v[untouched].any()


def test_cache_write_without_rope_copies_keys():
    gen = torch.Generator().manual_seed(4)
    qkv = torch.randn(3, 3 * 2 * 16, generator=gen).to(DEVICE)
    before = qkv.clone()
    k_cache = torch.zeros(2, 4, 2, 16).to(DEVICE)
    v_cache = torch.zeros_like(k_cache)
    rope_and_cache(qkv, None, k_cache, v_cache, torch.tensor([1, 2, 6]).to(DEVICE), 2, 2, 16)
    assert torch.equal(qkv, before)
    assert torch.equal(k_cache.view(-1, 2, 16)[6], before[2, 32:64].view(2, 16))
    assert torch.equal(v_cache.view(-1, 2, 16)[1], before[0, 64:].view(2, 16))


@pytest.mark.parametrize("dtype", [torch.float32, *HALF])
def test_rms_norm_and_residual_add_match_torch(dtype):
    from tokenloom.layers.norms import RMSNorm

    gen = torch.Generator().manual_seed(5)
    norm = RMSNorm(40, 1e-5)
    norm.weight.data = torch.randn(40, generator=gen)
    norm = norm.to(DEVICE, dtype)
    x = torch.randn(7, 40, generator=gen).to(DEVICE, dtype)
    residual = torch.randn(7, 40, generator=gen).to(DEVICE, dtype)
    assert close(rms_norm(x, norm.weight, 1e-5), norm.forward_native(x))
    want_out, want_res = norm.add_forward_native(x, residual)
    got_out, got_res = add_rms_norm(x, residual, norm.weight, 1e-5)
    assert torch.equal(got_res, want_res)
    assert close(got_out, want_out)
    assert not close(got_out, norm.forward_native(x))  # the residual was added


@pytest.mark.parametrize("dtype", [torch.float32, *HALF])
def test_silu_mul_matches_torch(dtype):
    gen = torch.Generator().manual_seed(6)
    gate_up = torch.randn(3, 2 * 1100, generator=gen).to(DEVICE, dtype)  # I = 1100: two column blocks
    want = torch.nn.functional.silu(gate_up[:, :1100]) * gate_up[:, 1100:]
    assert close(silu_mul(gate_up), want)
