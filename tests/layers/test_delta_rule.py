"""Gated DeltaNet's recurrence (layers/delta_rule.py) and its compiled decode step
(layers/csrc/mamba_step_cpu.cpp deltanet_decode) against the plain definitions: the chunked form
at any block size, split anywhere with its state carried, is the step-by-step recurrence in
float64; the one-call decode step is the torch path of the layer, state for state."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from tokenloom.layers import ssm_scan
from tokenloom.layers.delta_rule import delta_chunked, delta_step_slots
from tokenloom.models.config import DeltaNetConfig, ModelConfig

L, HEADS, DK, DV = 37, 3, 8, 6


def _inputs(seed: int = 0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(L, HEADS, DK, generator=g, dtype=dtype), dim=-1) * DK**-0.5
    k = F.normalize(torch.randn(L, HEADS, DK, generator=g, dtype=dtype), dim=-1)
    v = torch.randn(L, HEADS, DV, generator=g, dtype=dtype)
    decay = -2 * torch.rand(L, HEADS, generator=g, dtype=dtype)
    beta = torch.rand(L, HEADS, generator=g, dtype=dtype)
    s0 = torch.randn(HEADS, DK, DV, generator=g, dtype=dtype)
    return q, k, v, decay, beta, s0


def _recurrence(q, k, v, decay, beta, s):
    """S' = exp(g) S, u = beta (v - S'^T k), S = S' + k u^T, o = S^T q: one position at a time."""
    outs = []
    for t in range(q.shape[0]):
        s = s * decay[t].exp()[:, None, None]
        u = (v[t] - torch.einsum("hkv,hk->hv", s, k[t])) * beta[t][:, None]
        s = s + k[t][:, :, None] * u[:, None, :]
        outs.append(torch.einsum("hkv,hk->hv", s, q[t]))
    return torch.stack(outs), s


@pytest.mark.parametrize("block", [1, 5, 8, 64])
def test_the_chunked_delta_rule_is_the_recurrence(block):
    q, k, v, decay, beta, s0 = _inputs()
    want_o, want_s = _recurrence(q, k, v, decay, beta, s0)
    o, s = delta_chunked(q, k, v, decay, beta, s0, block)
    torch.testing.assert_close(o, want_o)
    torch.testing.assert_close(s, want_s)


def test_a_chunked_run_split_with_its_state_carried_is_the_whole_run():
    q, k, v, decay, beta, s0 = _inputs(1)
    whole, s_whole = delta_chunked(q, k, v, decay, beta, s0, 8)
    first, s = delta_chunked(q[:20], k[:20], v[:20], decay[:20], beta[:20], s0, 8)
    second, s = delta_chunked(q[20:], k[20:], v[20:], decay[20:], beta[20:], s, 8)
    torch.testing.assert_close(torch.cat([first, second]), whole)
    torch.testing.assert_close(s, s_whole)
    from_none, _ = delta_chunked(q, k, v, decay, beta, None, 8)  # no state carried in: zeros
    torch.testing.assert_close(from_none, _recurrence(q, k, v, decay, beta, torch.zeros_like(s0))[0])


def test_one_step_of_a_batch_advances_each_slot_and_keep_zero_starts_from_zero():
    q, k, v, decay, beta, s0 = _inputs(2)
    states = torch.randn(5, HEADS, DK, DV, dtype=torch.float64)
    states[3] = s0
    slots, keep = torch.tensor([3, 1]), torch.tensor([[1.0], [0.0]], dtype=torch.float64)
    o = delta_step_slots(states, slots, keep, q[:2], k[:2], v[:2], decay[:2], beta[:2])
    want0, s_kept = _recurrence(q[:1], k[:1], v[:1], decay[:1], beta[:1], s0)
    want1, s_fresh = _recurrence(q[1:2], k[1:2], v[1:2], decay[1:2], beta[1:2], torch.zeros_like(s0))
    torch.testing.assert_close(o, torch.cat([want0, want1]))
    torch.testing.assert_close(states[3], s_kept)
    torch.testing.assert_close(states[1], s_fresh)


def _mixer(seed: int = 0):
    """A Gated DeltaNet (2 key heads each serving 2 value heads, 16 key dims, 8 value dims), random weights."""
    from tokenloom.layers.gated_deltanet import GatedDeltaNet

    d = DeltaNetConfig(layers=(0,), num_k_heads=2, num_v_heads=4, k_head_dim=16, v_head_dim=8)
    cfg = ModelConfig("Qwen3NextForCausalLM", 64, 32, 2, 2, 1, 16, 64, 128, recurrent=d)
    torch.manual_seed(seed)
    mixer = GatedDeltaNet(cfg)
    with torch.no_grad():
        for p in mixer.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
        mixer.norm.weight.add_(1.0)
    return mixer, d


def _step(mixer, d, x, slots, keep_rows, conv, state):
    """One decode step of len(slots) sequences through the layer's forward (the attention op's
    signature: the step's metadata and the state cache come through `attend`)."""
    meta = SimpleNamespace(
        state_slots=slots,
        query_start=list(range(len(slots))),
        query_lens=[1] * len(slots),
        context_lens=[5 if kept else 1 for kept in keep_rows],
        num_seqs=len(slots),
        recurrent_batch_=None,
    )
    attend = SimpleNamespace(
        meta=meta, kv_cache=SimpleNamespace(states=SimpleNamespace(conv={0: conv}, state={0: state}))
    )
    return mixer.forward(x, attend, 0)


def test_the_compiled_decode_step_is_the_layers_torch_path(monkeypatch):
    if not ssm_scan.build():
        pytest.skip("the recurrent decode kernels do not build here")
    mixer, d = _mixer()
    x = torch.randn(3, 32, generator=torch.Generator().manual_seed(1))
    conv = torch.randn(6, d.conv_dim, d.conv_kernel - 1)
    state = torch.randn(6, d.num_v_heads, d.k_head_dim, d.v_head_dim)
    slots, keep = [4, 0, 2], [True, False, True]  # the second sequence starts from zero
    conv_k, state_k = conv.clone(), state.clone()
    calls = []
    kernel = torch.ops.tokenloom_ssm.deltanet_decode
    monkeypatch.setattr(torch.ops.tokenloom_ssm, "deltanet_decode", lambda *a: calls.append(1) or kernel(*a))
    got = _step(mixer, d, x, slots, keep, conv_k, state_k)
    assert calls == [1]  # the compiled step ran
    monkeypatch.setattr(ssm_scan, "build", lambda: False)  # the torch path
    want = _step(mixer, d, x, slots, keep, conv, state)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state_k, state, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(conv_k, conv)
