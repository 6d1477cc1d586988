"""The filter chain: from processed logits to the distribution each sampled row draws from.

A row runs its filters in its own order (``SamplingParams.sampler_order``: the request's
`samplers`, else DEFAULT_SAMPLERS: temperature, top-n-sigma, top-k, typical-p, top-p, min-p, XTC,
epsilon, eta); a filter whose setting is off changes nothing. Mirostat rows run temperature, then
mirostat, instead (as llama.cpp). Rows sharing an order are filtered together in one batched pass.

XTC fires with probability xtc_probability. Instead of flipping that coin, the chain returns
the mixture (1 - P) x (the rest of the chain on the uncut logits) + P x (the rest on the cut
ones): the same distribution for the token, with no extra random draw, and the exact target the
speculative verifier needs.

Greedy rows (temperature 0) take the argmax of the processed logits; no filter applies to them.

Speed: top-k (moved ahead of temperature and top-n-sigma, which keep a row's order), and top-p
when every row's nucleus lies in its 256 most likely tokens, narrow the rows to the columns that
survive (40 of 49,152 for top-k 40), so the filters after them and the
final softmax work on those only; a full sort of the vocabulary (far costlier than a selection:
docs/BENCHMARKS.md, 'Measurements behind design choices') runs only for a row whose nucleus is
wider.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from tokenloom.sampling import filters, ranked
from tokenloom.sampling.kernels import argmax as row_argmax
from tokenloom.sampling.metadata import SamplingMetadata
from tokenloom.sampling.mirostat import MIROSTAT, mirostat_v2_columns
from tokenloom.sampling.sparse import take_rows
from tokenloom.sampling.state import SamplingState
from tokenloom.sampling_params import SamplingParams

Filter = Callable[[torch.Tensor, list[SamplingParams], list[SamplingState]], torch.Tensor]

FILTERS: dict[str, Filter] = {
    "temperature": lambda x, ps, _: filters.apply_temperature(x, [p.temperature for p in ps]),
    "top_n_sigma": lambda x, ps, _: filters.apply_top_n_sigma(x, [p.top_n_sigma for p in ps]),
    "top_k": lambda x, ps, _: ranked.apply_top_k(x, [p.top_k for p in ps]),
    "typical_p": lambda x, ps, _: filters.apply_typical_p(x, [p.typical_p for p in ps]),
    "top_p": lambda x, ps, _: ranked.apply_top_p(x, [p.top_p for p in ps]),
    "min_p": lambda x, ps, _: filters.apply_min_p(x, [p.min_p for p in ps]),
    "xtc": lambda x, ps, _: filters.xtc_cut(x, [p.xtc_threshold for p in ps]),
    "epsilon_cutoff": lambda x, ps, _: filters.apply_epsilon_cutoff(x, [p.epsilon_cutoff for p in ps]),
    "eta_cutoff": lambda x, ps, _: filters.apply_eta_cutoff(x, [p.eta_cutoff for p in ps]),
    "mirostat": lambda x, ps, ss: _mirostat(x, ps, ss),
}


def _mirostat(logits: torch.Tensor, params: list[SamplingParams], states: list[SamplingState]) -> torch.Tensor:
    if len({p.mirostat for p in params}) == 1:
        return MIROSTAT[params[0].mirostat](logits, [s.mirostat_mu for s in states])
    out = logits.clone()
    for version, truncate in MIROSTAT.items():
        rows = [i for i, p in enumerate(params) if p.mirostat == version]
        if rows:
            out[rows] = truncate(logits[rows], [states[i].mirostat_mu for i in rows])
    return out


def _mirostat_columns(logits: torch.Tensor, params: list[SamplingParams], states: list[SamplingState]):
    if all(p.mirostat == 2 for p in params):
        return mirostat_v2_columns(logits, [s.mirostat_mu for s in states])
    return None


# stages that can narrow the rows to the columns that survive them:
# name -> (logits, params, states) -> (logits, columns) | None
NARROWING = {
    "top_k": lambda x, ps, _: ranked.top_k_columns(x, [p.top_k for p in ps]),
    "top_p": lambda x, ps, _: ranked.top_p_columns(x, [p.top_p for p in ps]),
    "mirostat": _mirostat_columns,
}


ORDER_KEEPING = frozenset({"temperature", "top_n_sigma"})  # they scale a row, or cut it below a threshold


def _top_k_first(
    logits: torch.Tensor, stages: tuple[str, ...], params: list[SamplingParams], states: list[SamplingState]
) -> tuple[torch.Tensor, Columns] | None:
    """`_run` with top-k moved ahead of the temperature and top-n-sigma stages before it, which
    keep a row's order (so top-k keeps the same tokens; with top-n-sigma's cut first or last,
    the survivors are those above both thresholds): narrow the full rows to top-k's columns,
    then cut by top-n-sigma's threshold (the full row's statistics) and divide by the
    temperature there only. None where that does not apply (then `_run` as written)."""
    at = stages.index("top_k") if "top_k" in stages else 0
    if at == 0 or not ORDER_KEEPING.issuperset(stages[:at]):
        return None
    narrowed = ranked.top_k_columns(logits, [p.top_k for p in params])
    if narrowed is None:
        return None
    kept, columns = narrowed  # (R, W) each
    if "top_n_sigma" in stages[:at] and any(p.top_n_sigma > 0 for p in params):
        kept = kept.masked_fill(
            kept < filters.top_n_sigma_threshold(logits, [p.top_n_sigma for p in params]), filters.NEG_INF
        )
    if "temperature" in stages[:at]:
        kept = FILTERS["temperature"](kept, params, states)
    probs, inner = _run(kept, stages[at + 1 :], params, states)
    return probs, (columns if inner is None else columns.gather(1, inner))


def row_stages(params: SamplingParams) -> tuple[str, ...]:
    """The filters a sampled row runs, in order."""
    return ("temperature", "mirostat") if params.mirostat else params.sampler_order


Columns = torch.Tensor | None  # (R, W): which columns of the input each of W entries is; None: all, in order


def expand(probs: torch.Tensor, columns: Columns, width: int) -> torch.Tensor:
    """probs (R, W) at `columns` -> (R, width) with zeros elsewhere."""
    if columns is None:
        return probs
    return torch.zeros(probs.shape[0], width, dtype=probs.dtype, device=probs.device).scatter(1, columns, probs)


def _run(
    logits: torch.Tensor, stages: tuple[str, ...], params: list[SamplingParams], states: list[SamplingState]
) -> tuple[torch.Tensor, Columns]:
    """logits (R, C) through `stages` -> (probabilities (R, W), their columns of `logits`), XTC as
    the mixture of its branches."""
    if (early := _top_k_first(logits, stages, params, states)) is not None:
        return early
    for at, name in enumerate(stages):
        if name in NARROWING and (narrowed := NARROWING[name](logits, params, states)) is not None:
            kept, columns = narrowed  # (R, W) each
            probs, inner = _run(kept, stages[at + 1 :], params, states)
            return probs, (columns if inner is None else columns.gather(1, inner))
        if name == "xtc":
            firing = [i for i, p in enumerate(params) if p.xtc_probability > 0]
            if not firing:
                continue
            rest, width = stages[at + 1 :], logits.shape[1]
            uncut = expand(*_run(logits, rest, params, states), width)
            cut = uncut.clone()
            cut[firing] = expand(
                *_run(
                    FILTERS["xtc"](take_rows(logits, firing), [params[i] for i in firing], []),
                    rest,
                    [params[i] for i in firing],
                    [states[i] for i in firing],
                ),
                width,
            )
            chance = torch.tensor([p.xtc_probability for p in params], dtype=logits.dtype, device=logits.device)[
                :, None
            ]
            return (1 - chance) * uncut + chance * cut, None
        logits = FILTERS[name](logits, params, states)
    return logits.softmax(-1), None


def distribution_columns(logits: torch.Tensor, meta: SamplingMetadata) -> tuple[torch.Tensor, Columns]:
    """Processed logits (B, V) of sampled rows -> (the probabilities each draws from, at `columns`
    of the vocabulary (B, W); None: all V in order). Rows sharing an order go through together."""
    groups: dict[tuple[str, ...], list[int]] = {}
    for i, p in enumerate(meta.params):
        groups.setdefault(row_stages(p), []).append(i)
    assert meta.states is not None  # __post_init__ fills it
    if len(groups) == 1:
        return _run(logits, next(iter(groups)), meta.params, meta.states)
    probs = torch.empty_like(logits)
    for stages, rows in groups.items():
        probs[rows] = expand(
            *_run(take_rows(logits, rows), stages, [meta.params[i] for i in rows], [meta.states[i] for i in rows]),
            logits.shape[1],
        )
    return probs, None


def sampling_distribution(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Processed logits (B, V) of sampled rows -> the probabilities (B, V) each draws from."""
    return expand(*distribution_columns(logits, meta), logits.shape[1])


def greedy_and_distribution(
    logits: torch.Tensor, meta: SamplingMetadata
) -> tuple[torch.Tensor, list[int], torch.Tensor | None]:
    """Processed logits (B, V) -> (argmax (B,), the non-greedy rows, their distributions
    (len(rows), V) or None when every row is greedy)."""
    argmax = row_argmax(logits)
    rows = [i for i, p in enumerate(meta.params) if not p.greedy]
    return argmax, rows, (sampling_distribution(take_rows(logits, rows), meta.rows(rows)) if rows else None)
