"""Mamba-2's selective state-space recurrence, per head h with state H (head_dim x state_size):

    H_t = exp(dt_t A) H_{t-1} + dt_t x_t B_t^T        y_t = H_t C_t

(x_t: the head's head_dim inputs, B_t and C_t: its group's state_size vectors, dt_t > 0 its step,
A < 0 its decay.) Two ways to run it, the same numbers up to float rounding:

- ``ssm_step``: one token of each of a batch of sequences, the state updated in place (decode);
  ``ssm_step_slots`` runs it on states kept in a slot cache, through a compiled CPU kernel
  (``csrc/mamba_step_cpu.cpp``: each state row read and written once) where it builds;
- ``ssd_scan``: a prompt chunk of one sequence in blocks of `chunk_size` positions (the "state
  space duality" form): within a block the outputs are a masked, decay-weighted C B^T product
  applied to dt x (an attention-like matmul), plus the decayed carried-in state read by C; the
  state after the block is the carried state decayed over the block plus each position's
  contribution decayed to the block's end. Exact for any block size, so a prompt split anywhere
  (chunked prefill) gives the same outputs as whole.

Everything here computes in float32.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tokenloom.kernels import native

_SOURCE = Path(__file__).parent / "csrc" / "mamba_step_cpu.cpp"


def build() -> bool:
    """Compile and register the decode-step kernels (the SSM's and the conv's: once per process);
    False where they cannot be."""
    return native.load(_SOURCE, "Mamba-2 decode step kernels")


def decode_step_takes(rows: tuple[torch.Tensor, ...], conv_states: torch.Tensor, dt_bias: torch.Tensor) -> bool:
    """A recurrent mixer's compiled decode step (Mamba-2's, Gated DeltaNet's) runs here: its input
    `rows` float32 on the CPU with unit stride, the conv state and dt_bias float32, the state
    contiguous, and the kernels built."""
    return (
        all(r.device.type == "cpu" and r.dtype == torch.float32 and r.stride(-1) == 1 for r in rows)
        and conv_states.dtype == dt_bias.dtype == torch.float32
        and conv_states.is_contiguous()
        and build()
    )


class DecayRates:
    """A mixer's per-head decay rates A = -exp(A_log), float32, computed once per device (the
    weights are fixed once loaded): Mamba-2 and Gated DeltaNet both hold A_log."""

    A_log: torch.Tensor
    _A: torch.Tensor | None = None

    def _decay_rates(self) -> torch.Tensor:
        if self._A is None or self._A.device != self.A_log.device:
            self._A = -torch.exp(self.A_log.detach().float())
        return self._A


def ssm_step(
    state: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor
) -> torch.Tensor:
    """One step of S sequences: state (S, heads, head_dim, N) updated in place; x (S, heads,
    head_dim), dt (S, heads) (after softplus), A (heads,), B and C (S, heads, N) (groups expanded)
    -> y (S, heads, head_dim) (without the D skip)."""
    decay = torch.exp(dt * A)  # (S, heads)
    state.mul_(decay[..., None, None])
    state.add_((dt[..., None] * x)[..., None] * B[:, :, None, :])  # dt x B^T: (S, heads, head_dim, N)
    return torch.matmul(state, C[..., None]).squeeze(-1)


def ssm_step_slots(
    states: torch.Tensor,
    slots: torch.Tensor,
    keep: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
) -> torch.Tensor:
    """One step of S sequences whose states are rows `slots` (S,) of `states` (slots, heads,
    head_dim, N), each from zero where `keep` (S, 1) is 0; x (S, heads, head_dim), dt (S, heads),
    A (heads,), B and C (S, groups, N) -> y (S, heads, head_dim); the rows updated in place."""
    if states.device.type == "cpu" and states.is_contiguous() and build():
        return torch.ops.tokenloom_ssm.ssm_step(
            states, slots, keep.reshape(-1), x.contiguous(), dt.contiguous(), A, B.contiguous(), C.contiguous()
        )
    per_group = x.shape[1] // B.shape[1]
    state = states.index_select(0, slots) * keep[..., None, None]  # (S, heads, head_dim, N)
    y = ssm_step(state, x, dt, A, B.repeat_interleave(per_group, dim=1), C.repeat_interleave(per_group, dim=1))
    states.index_copy_(0, slots, state)
    return y


def _segment_sums(a: torch.Tensor) -> torch.Tensor:
    """a (Q, heads) per-position log decays -> (heads, Q, Q): entry [h, l, s] = sum of a[s+1 .. l]
    for s <= l (0 on the diagonal), -inf above it; summed position by position (a running sum over
    masked rows, not a difference of two long cumulative sums, which loses digits)."""
    q = a.shape[0]
    lower = torch.ones(q, q, dtype=torch.bool, device=a.device)
    rows = a.t()[..., None].expand(-1, q, q)  # (heads, Q(k), Q(s)): a[k]
    sums = torch.cumsum(rows.masked_fill(~lower.tril(-1), 0.0), dim=1)  # [h, l, s]: a[k] for s < k <= l
    return sums.masked_fill(~lower.tril(), float("-inf"))


def _decay(log_decay: torch.Tensor) -> torch.Tensor:
    """exp(log_decay), with decays below e^-80 (~1.8e-35, nothing beside a sum of order 1) set to
    exactly 0: their exponentials would be float32 denormals, on which x86 arithmetic slows by
    orders of magnitude."""
    return torch.exp(log_decay.masked_fill(log_decay < -80.0, float("-inf")))


def ssd_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    state: torch.Tensor | None,
    chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's L positions: x (L, heads, head_dim), dt (L, heads) (after softplus), A
    (heads,), B and C (L, groups, N) (heads h of a group consecutive: group h // (heads / groups)),
    state (heads, head_dim, N) carried in (None: zeros) -> (y (L, heads, head_dim) without the D
    skip, the state after the last position). Each group's C B^T is computed once for its heads, and the carried
    state is read and updated one matmul a group."""
    L, H, P = x.shape
    G, N = B.shape[1:]
    per = H // G
    ys = []
    for start in range(0, L, chunk_size):
        block = slice(start, start + chunk_size)
        xb, dtb, Bb, Cb = x[block], dt[block], B[block], C[block]
        Q = xb.shape[0]
        a = dtb * A  # (Q, heads): each position's log decay
        decay_in = _decay(_segment_sums(a)).view(G, per, Q, Q)  # position s's decay up to l
        scores = torch.bmm(Cb.transpose(0, 1), Bb.permute(1, 2, 0))  # (G, Q(l), Q(s)): C_l . B_s
        weights = decay_in * scores[:, None] * dtb.t().reshape(G, per, 1, Q)  # (G, per, Q, Q)
        y = weights @ xb.permute(1, 0, 2).reshape(G, per, Q, P)  # (G, per, Q, P)
        cum = torch.cumsum(a, dim=0)  # (Q, heads): the decay from the block's start
        if state is not None:  # the carried-in state read by C, decayed
            carried = torch.bmm(Cb.transpose(0, 1), state.view(G, per * P, N).transpose(1, 2))  # (G, Q, per P)
            y += _decay(cum).t().reshape(G, per, Q, 1) * carried.view(G, Q, per, P).transpose(1, 2)
        ys.append(y.reshape(H, Q, P).transpose(0, 1))
        to_end = _decay(cum[-1] - cum) * dtb  # (Q, heads): position s's weight at the block's end
        added = torch.bmm((xb * to_end[..., None]).reshape(Q, G, per * P).permute(1, 2, 0), Bb.transpose(0, 1))
        added = added.view(H, P, N)  # from (G, per P, N)
        state = added if state is None else _decay(cum[-1])[:, None, None] * state + added
    assert state is not None  # L >= 1 positions
    return torch.cat(ys), state
