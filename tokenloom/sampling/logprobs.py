"""{token: logprob} entries: the chosen token's log-probability and the top N, per row."""

from __future__ import annotations

import torch

from tokenloom.outputs import TokenLogprobs


def logprob_entries(
    logprobs: torch.Tensor, chosen: torch.Tensor, top_n: list[int | None]
) -> list[TokenLogprobs | None]:
    """logprobs (B, V) float32, chosen (B,) int64 -> per row i: {token: logprob} holding chosen[i]
    and the row's top_n[i] most likely tokens; None where top_n[i] is None."""
    wanted = [n for n in top_n if n is not None]
    if not wanted:
        return [None] * len(top_n)
    widest = max(wanted)
    top_vals: list[list[float]] = []  # read only for rows with n > 0, so when widest > 0
    top_ids: list[list[int]] = []
    if widest:
        vals, ids = logprobs.topk(widest, dim=-1)
        top_vals, top_ids = vals.tolist(), ids.tolist()
    chosen_ids = chosen.tolist()
    chosen_vals = logprobs.gather(1, chosen[:, None])[:, 0].tolist()
    out: list[TokenLogprobs | None] = []
    for i, n in enumerate(top_n):
        if n is None:
            out.append(None)
            continue
        entry = dict(zip(top_ids[i][:n], top_vals[i][:n])) if n else {}
        entry[chosen_ids[i]] = chosen_vals[i]
        out.append(entry)
    return out
