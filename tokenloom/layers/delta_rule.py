"""The gated delta rule (Qwen3-Next's Gated DeltaNet layers), per value head with state S
(k_dim x v_dim), for tokens t with key k_t and query q_t (L2-normed; q scaled by k_dim ** -0.5),
value v_t, write strength beta_t in (0, 1) and log decay g_t <= 0:

    S' = exp(g_t) S_{t-1}                      (forget)
    u_t = beta_t (v_t - S'^T k_t)              (what k_t should read, minus what it reads now)
    S_t = S' + k_t u_t^T                       (write)
    o_t = S_t^T q_t

Two ways to run it, the same numbers up to float rounding:

- ``delta_step_slots``: one token of each of a batch of sequences whose states are rows of a
  slot cache (decode), the states updated in place;
- ``delta_chunked``: a prompt chunk of one sequence in blocks of `block` positions. Within a block
  the writes u depend on each other only through a unit lower-triangular system,
  (I + A) U = beta V - (beta K exp(G)) S0 with A[t, j] = beta_t (k_t . k_j) exp(G_t - G_j) (j < t)
  and G the block's cumulative log decay, solved once for every block; then block by block,
  o_t = exp(G_t) S0^T q_t + sum_{j <= t} exp(G_t - G_j) (q_t . k_j) u_j and
  S = exp(G_last) S0 + sum_j exp(G_last - G_j) k_j u_j^T. Exact for any block size, so a prompt
  split anywhere (chunked prefill) gives the outputs of the whole.

Every exponent is of a difference G_t - G_j with j <= t (or G_t itself), so each is <= 0: nothing
overflows. Everything here computes in float32 (float64 where given float64: the tests' reference).
"""

from __future__ import annotations

import torch


def delta_step_slots(
    states: torch.Tensor,
    slots: torch.Tensor,
    keep: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
) -> torch.Tensor:
    """One step of S sequences whose states are rows `slots` (S,) of `states` (slots, heads, k_dim,
    v_dim) float32; `keep` (S, 1) 0.0 where a sequence starts from zero. q, k (S, heads, k_dim)
    (normed, q scaled), v (S, heads, v_dim), g and beta (S, heads) -> o (S, heads, v_dim); the
    states advanced in place."""
    forget = keep.view(-1, 1) * torch.exp(g)  # (S, H): 0 where the sequence starts from zero
    state = states.index_select(0, slots) * forget[..., None, None]  # S' (S, H, dk, dv)
    read = torch.einsum("shkv,shk->shv", state, k)  # S'^T k
    u = (v - read) * beta[..., None]  # (S, H, dv)
    state.add_(k[..., None] * u[..., None, :])
    states.index_copy_(0, slots, state)
    return torch.einsum("shkv,shk->shv", state, q)


def delta_chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor | None,
    block: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's L tokens: q, k (L, heads, k_dim) (normed, q scaled), v (L, heads, v_dim),
    g and beta (L, heads), `state` (heads, k_dim, v_dim) before them (None: zeros) -> (o (L, heads,
    v_dim), the state after them). Blocks of `block` positions (the last one padded)."""
    L, H, dk = k.shape
    dv = v.shape[-1]
    pad = (-L) % block
    n = (L + pad) // block
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32

    def blocks(x: torch.Tensor) -> torch.Tensor:  # (L, H, ...) -> (H, n, block, ...)
        x = x.to(dtype).transpose(0, 1)
        if pad:
            x = torch.nn.functional.pad(x, (0, 0) * (x.dim() - 2) + (0, pad))
        return x.reshape(H, n, block, *x.shape[2:])

    q, k, v = blocks(q), blocks(k), blocks(v)  # (H, n, C, d)
    g, beta = blocks(g), blocks(beta)  # (H, n, C)
    G = g.cumsum(-1)  # (H, n, C): the block's cumulative log decay
    lower = torch.ones(block, block, dtype=torch.bool, device=q.device).tril()
    diff = (G[..., :, None] - G[..., None, :]).masked_fill(~lower, float("-inf"))
    decay = diff.exp()  # (H, n, C, C): exp(G_t - G_j) for j <= t, else 0
    k_beta = k * beta[..., None]
    A = (k_beta @ k.transpose(-1, -2)) * decay  # beta_t (k_t . k_j) exp(G_t - G_j)
    system = A.tril(-1) + torch.eye(block, dtype=dtype, device=q.device)
    W = torch.linalg.solve_triangular(system, v * beta[..., None], upper=False, unitriangular=True)  # (H, n, C, dv)
    Kc = torch.linalg.solve_triangular(system, k_beta * G.exp()[..., None], upper=False, unitriangular=True)
    scores = (q @ k.transpose(-1, -2)) * decay  # (H, n, C, C) (q_t . k_j) exp(G_t - G_j), j <= t
    q_decayed = q * G.exp()[..., None]
    to_end = (G[..., -1:] - G).exp()[..., None] * k  # (H, n, C, dk): k_j exp(G_last - G_j)
    S = torch.zeros(H, dk, dv, dtype=dtype, device=q.device) if state is None else state.to(dtype)
    out = torch.empty(H, n, block, dv, dtype=dtype, device=q.device)
    for c in range(n):
        U = W[:, c] - Kc[:, c] @ S  # (H, C, dv)
        out[:, c] = q_decayed[:, c] @ S + scores[:, c] @ U
        S = S * G[:, c, -1].exp()[:, None, None] + to_end[:, c].transpose(-1, -2) @ U
    return out.reshape(H, n * block, dv)[:, :L].transpose(0, 1), S
