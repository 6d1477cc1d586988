"""Mamba-2's recurrence (layers/ssm_scan.py) and its causal conv (layers/causal_conv.py) against
the plain definitions, in float64: the chunked scan at any block size, split anywhere with its
state carried, equals the step-by-step recurrence; the conv run in pieces equals one zero-padded
conv over the whole sequence."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tokenloom.layers.causal_conv import CausalConv1d
from tokenloom.layers.ssm_scan import ssd_scan, ssm_step

L, HEADS, GROUPS, P, N = 37, 4, 2, 3, 5


def _inputs(seed: int = 0):
    """x, dt, A, B and C per group (L, GROUPS, N), a carried-in state."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(L, HEADS, P, generator=g, dtype=torch.float64)
    dt = F.softplus(torch.randn(L, HEADS, generator=g, dtype=torch.float64))
    A = -torch.rand(HEADS, generator=g, dtype=torch.float64) * 2
    B = torch.randn(L, GROUPS, N, generator=g, dtype=torch.float64)
    C = torch.randn(L, GROUPS, N, generator=g, dtype=torch.float64)
    h0 = torch.randn(HEADS, P, N, generator=g, dtype=torch.float64)
    return x, dt, A, B, C, h0


def _per_head(t: torch.Tensor) -> torch.Tensor:
    return t.repeat_interleave(HEADS // GROUPS, dim=1)


def _recurrence(x, dt, A, B, C, h):
    """H_t = exp(dt_t A) H_{t-1} + dt_t x_t B_t^T, y_t = H_t C_t, one position at a time."""
    ys = []
    for t in range(x.shape[0]):
        h = torch.exp(dt[t] * A)[:, None, None] * h + (dt[t][:, None] * x[t])[..., None] * B[t][:, None, :]
        ys.append(torch.einsum("hpn,hn->hp", h, C[t]))
    return torch.stack(ys), h


@pytest.mark.parametrize("chunk_size", [1, 5, 8, 64])
def test_the_chunked_scan_is_the_recurrence(chunk_size):
    x, dt, A, B, C, h0 = _inputs()
    want_y, want_h = _recurrence(x, dt, A, _per_head(B), _per_head(C), h0)
    y, h = ssd_scan(x, dt, A, B, C, h0, chunk_size)
    torch.testing.assert_close(y, want_y)
    torch.testing.assert_close(h, want_h)


def test_a_scan_split_with_its_state_carried_is_the_whole_scan():
    x, dt, A, B, C, h0 = _inputs(1)
    whole, h_whole = ssd_scan(x, dt, A, B, C, h0, 8)
    first, h = ssd_scan(x[:20], dt[:20], A, B[:20], C[:20], h0, 8)
    second, h = ssd_scan(x[20:], dt[20:], A, B[20:], C[20:], h, 8)
    torch.testing.assert_close(torch.cat([first, second]), whole)
    torch.testing.assert_close(h, h_whole)
    from_none = ssd_scan(x, dt, A, B, C, None, 8)  # no state carried in: zeros
    from_zeros = ssd_scan(x, dt, A, B, C, torch.zeros_like(h0), 8)
    torch.testing.assert_close(from_none, from_zeros)


def test_one_step_of_a_batch_updates_each_state_in_place():
    x, dt, A, B, C, h0 = _inputs(2)
    states = torch.stack([h0, 2 * h0])  # two sequences
    B, C = _per_head(B), _per_head(C)
    want = [_recurrence(x[i : i + 1], dt[i : i + 1], A, B[i : i + 1], C[i : i + 1], states[i]) for i in range(2)]
    y = ssm_step(states, x[:2], dt[:2], A, B[:2], C[:2])
    for i in range(2):
        torch.testing.assert_close(y[i], want[i][0][0])
        torch.testing.assert_close(states[i], want[i][1])


def test_the_conv_in_pieces_is_one_zero_padded_conv():
    channels, kernel = 6, 4
    conv = CausalConv1d(channels, kernel).double()
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        conv.weight.copy_(torch.randn(channels, 1, kernel, generator=g))
        conv.bias.copy_(torch.randn(channels, generator=g))
    x = torch.randn(11, channels, generator=g, dtype=torch.float64)
    want = F.conv1d(x.t()[None], conv.weight, conv.bias, padding=kernel - 1, groups=channels)[0, :, :11].t()
    states = torch.full((3, channels, kernel - 1), 7.0, dtype=torch.float64)  # slot 1 holds another's inputs
    got = [conv.prompt(x[:2], states[1], fresh=True), conv.prompt(x[2:7], states[1], fresh=False)]
    for t in range(7, 11):  # then token by token, alongside slot 2's own sequence
        both = conv.step(torch.stack([x[t], x[t]]), states, torch.tensor([1, 2]), torch.tensor([[1.0], [1.0]]))
        got.append(both[:1])
    torch.testing.assert_close(torch.cat(got), want)


def test_the_decode_kernel_steps_slots_as_the_recurrence_does():
    """The compiled step (float32, groups shared by heads, a slot starting from zero) against the
    float64 recurrence on the same slots; other slots untouched."""
    from tokenloom.layers import ssm_scan

    if not ssm_scan.build():
        pytest.skip("the CPU kernels do not build here")
    g = torch.Generator().manual_seed(4)
    heads, groups, n = 6, 2, 12  # a state width off the 8-lane vectors
    states = torch.randn(5, heads, P, n, generator=g)
    x, dt = torch.randn(3, heads, P, generator=g), F.softplus(torch.randn(3, heads, generator=g))
    A = -torch.rand(heads, generator=g)
    B, C = torch.randn(3, groups, n, generator=g), torch.randn(3, groups, n, generator=g)
    slots, keep = torch.tensor([4, 0, 2]), torch.tensor([[1.0], [0.0], [1.0]])
    before = states.clone()
    y = ssm_scan.ssm_step_slots(states, slots, keep, x, dt, A, B, C)
    for i, slot in enumerate(slots.tolist()):
        h0 = before[slot].double() * keep[i].double()
        Bh, Ch = (t[i : i + 1].double().repeat_interleave(heads // groups, dim=1) for t in (B, C))
        want_y, want_h = _recurrence(x[i : i + 1].double(), dt[i : i + 1].double(), A.double(), Bh, Ch, h0)
        torch.testing.assert_close(y[i].double(), want_y[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(states[slot].double(), want_h, rtol=1e-5, atol=1e-5)
    assert torch.equal(states[[1, 3]], before[[1, 3]])


def test_the_decode_conv_kernel_is_the_torch_step():
    from tokenloom.layers import ssm_scan

    if not ssm_scan.build():
        pytest.skip("the CPU kernels do not build here")
    channels, kernel = 10, 4
    conv = CausalConv1d(channels, kernel)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        conv.weight.copy_(torch.randn(channels, 1, kernel, generator=g))
        conv.bias.copy_(torch.randn(channels, generator=g))
    states = torch.randn(4, channels, kernel - 1, generator=g)
    x = torch.randn(3, 2 * channels, generator=g)[:, :channels]  # a column slice, as the mixer passes it
    slots, keep = torch.tensor([3, 0, 1]), torch.tensor([[1.0], [0.0], [1.0]])
    want_states = states.clone()
    before = want_states.index_select(0, slots) * keep[..., None]
    window = torch.cat([before, x[..., None]], dim=2)
    want = (window * conv.weight[:, 0]).sum(-1) + conv.bias
    want_states.index_copy_(0, slots, window[..., 1:])
    torch.testing.assert_close(conv.step(x, states, slots, keep), want)
    torch.testing.assert_close(states, want_states)
