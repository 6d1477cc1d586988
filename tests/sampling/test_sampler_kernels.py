"""The sampler's selection kernels (csrc/select_cpu.cpp; their torch fallbacks where a test does
not need the kernel itself) against torch and float64 numpy on vocabulary-sized rows, and the
chain's top-k-first shortcut against a numpy restatement of the chain as written (temperature,
top-n-sigma, top-k in that order)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tokenloom import SamplingParams
from tokenloom.sampling import SamplingMetadata, kernels, ranked
from tokenloom.sampling.chain import sampling_distribution

V = 49_152
NEG_INF = float("-inf")


def _rows(seed: int, rows: int = 12, width: int = V) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, width, generator=g) * 4
    x[1, torch.randperm(width, generator=g)[: width // 2]] = NEG_INF  # half the vocabulary banned
    x[2] = NEG_INF  # nothing finite
    x[3] = NEG_INF
    x[3, :5] = torch.tensor([3.0, 1.0, 2.0, 5.0, 4.0])  # fewer finite than k
    x[4] = torch.round(x[4])  # many ties
    x[5] = torch.arange(width, dtype=torch.float32)  # ascending: every block beats the last
    return x


needs_kernels = pytest.mark.skipif(not kernels.enabled(torch.zeros(1, 8)), reason="selection kernels not built")


@needs_kernels
@pytest.mark.parametrize("k", [1, 40, 41, 256, 3072])
def test_row_top_k_holds_torch_topk_values_and_points_at_them(k):
    x = _rows(k)
    values, columns = torch.ops.tokenloom_select.row_top_k(x, k)
    expected = x.topk(k, dim=-1).values
    assert torch.equal(values, expected)  # the same values, largest first
    assert torch.equal(x.gather(1, columns), values)  # each column holds its value
    assert all(len(set(row)) == k for row in columns.tolist())  # k distinct columns
    tied = values[:, :-1] == values[:, 1:]
    assert torch.all((columns[:, :-1] < columns[:, 1:]) | ~tied)  # ties: the lower column first


@needs_kernels
def test_row_top_k_on_an_odd_width_and_strided_rows():
    x = _rows(7, width=1001)
    wide = torch.cat([x, torch.zeros(12, 3)], dim=1)[:, :1001]  # rows of stride 1004
    values, columns = torch.ops.tokenloom_select.row_top_k(wide, 60)
    assert torch.equal(values, x.topk(60, dim=-1).values) and torch.equal(x.gather(1, columns), values)


@needs_kernels
@pytest.mark.parametrize("width", [V, 1001, 7])
def test_row_finite_stats_equal_float64(width):
    x = _rows(3, width=width)
    stats = kernels.row_finite_stats(x)
    for i, row in enumerate(x.double().numpy()):
        finite = row[np.isfinite(row)]
        if len(finite) == 0:
            assert stats[i].tolist() == [0.0, 0.0, 0.0, NEG_INF]
            continue
        assert stats[i, 0] == len(finite) and stats[i, 3] == finite.max()
        assert stats[i, 1].item() == pytest.approx(finite.mean(), abs=1e-5)
        assert stats[i, 2].item() == pytest.approx(finite.std(), rel=1e-5)


def test_top_k_columns_fall_back_only_for_a_tie_beyond_them():
    x = torch.randn(2, 4096)
    x[0, 100] = x[0, 200] = 50.0  # a tie inside the kept columns: narrowed
    x[1, :3] = torch.tensor([60.0, 59.0, 58.0])
    x[1, 3000] = 58.0  # k = 3: the third largest is tied beyond the three kept
    assert ranked.top_k_columns(x[:1], [2]) is not None
    assert ranked.top_k_columns(x[1:], [3]) is None
    kept, columns = ranked.top_k_columns(x, [2, 2])
    assert sorted(columns[0].tolist()) == [100, 200] and torch.isfinite(kept).all()


def _chain_as_written(row: np.ndarray, p: SamplingParams) -> np.ndarray:
    """temperature, top-n-sigma, top-k, top-p, in that order, in float64 numpy."""
    x = row / p.temperature
    finite = x[np.isfinite(x)]
    if p.top_n_sigma:
        x = np.where(x >= finite.max() - p.top_n_sigma * finite.std(), x, -np.inf)
    if p.top_k:
        x = np.where(x >= np.sort(x)[::-1][p.top_k - 1], x, -np.inf)
    probs = np.exp(x - x.max())
    probs /= probs.sum()
    if p.top_p < 1:
        order = np.argsort(-probs, kind="stable")
        before = np.cumsum(probs[order]) - probs[order]
        probs[order[before >= p.top_p]] = 0
        probs /= probs.sum()
    return probs


def test_top_k_ahead_of_temperature_and_top_n_sigma_gives_the_chain_as_written():
    """The default order runs temperature and top-n-sigma before top-k; the chain narrows to top-k's
    columns first. Rows where top-n-sigma cuts deeper than top-k, where top-k cuts deeper, and
    where a tie lies beyond top-k's columns (the full path) must all match the order as written."""
    x = _rows(11, rows=6)
    x[4, :3] = torch.tensor([9.0, 8.0, 7.0])
    x[4, 40_000] = 7.0  # a tie at k = 3, far away
    params = [
        SamplingParams(temperature=0.7, top_n_sigma=1.0, top_k=40),
        SamplingParams(temperature=1.3, top_n_sigma=3.5, top_k=40),
        SamplingParams(temperature=0.5, top_k=12, top_p=0.9),
        SamplingParams(temperature=0.9, top_n_sigma=2.0, top_k=500),
        SamplingParams(temperature=1.0, top_n_sigma=9.0, top_k=3),
        SamplingParams(temperature=0.8, top_n_sigma=0.5, top_k=100, top_p=0.95),
    ]
    keep = [0, 1, 3, 4, 5]  # row 2 of _rows has nothing finite
    x, params = x[keep], [params[i] for i in keep]
    n = len(params)
    meta = SamplingMetadata(params, [[]] * n, [[]] * n, [None] * n, [frozenset()] * n)
    ours = sampling_distribution(x, meta).double().numpy()
    for i, p in enumerate(params):
        expected = _chain_as_written(x[i].double().numpy(), p)
        assert np.array_equal(ours[i] > 0, expected > 0), i
        np.testing.assert_allclose(ours[i], expected, atol=1e-6)


def test_row_logsumexp_equals_torch():
    x = _rows(5)
    x[5] = x[5] / 1000  # a spread row (0 .. 49)
    ours = kernels.logsumexp(x)[:, 0]
    expected = torch.logsumexp(x.double(), -1)
    assert ours[2] == NEG_INF  # nothing finite
    keep = torch.isfinite(expected)
    torch.testing.assert_close(ours[keep].double(), expected[keep], rtol=1e-6, atol=1e-5)


def test_count_and_columns_at_least_a_floor():
    x = _rows(9, width=5000)
    floor = x.max(-1, keepdim=True).values - torch.linspace(0, 6, 12)[:, None]
    floor[2] = 0.0  # a row of -inf: nothing reaches it
    counts = kernels.count_at_least(x, floor)
    assert torch.equal(counts, (x >= floor).sum(-1))
    width = int(counts.max()) + 3
    values, columns = kernels.at_least(x, floor, width)
    for i in range(12):
        kept = (x[i] >= floor[i]).nonzero().flatten()
        assert columns[i, : len(kept)].tolist() == kept.tolist()  # the kept ones, in column order
        assert torch.equal(values[i, : len(kept)], x[i, kept])
        assert (values[i, len(kept) :] == NEG_INF).all() and len(set(columns[i].tolist())) == width
    with pytest.raises((RuntimeError, ValueError), match="more than width"):
        kernels.at_least(x, floor, int(counts.max()) - 1)


def test_mirostat_v2_narrowed_keeps_what_the_full_filter_keeps():
    from tokenloom.sampling.mirostat import mirostat_v2, mirostat_v2_columns

    x = _rows(13, rows=8)[[0, 1, 4, 5, 6, 7]]
    x[3, 7] = x[3, 9] = x[3].max() + 1  # tied maxima
    mu = [10.0, 6.0, 3.0, 0.01, 12.0, 0.01]  # mu ~0: only the most likely token
    full = mirostat_v2(x, mu)
    values, columns = mirostat_v2_columns(x, mu)
    narrowed = torch.full_like(x, NEG_INF).scatter(1, columns, values)
    assert torch.equal(narrowed, full)
    assert torch.isfinite(narrowed[3]).sum() == 1 and torch.isfinite(narrowed[3, 7])
