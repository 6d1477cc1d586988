"""The sampler draws from the distribution each parameter defines (chi-square tests)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from tokenloom import SamplingParams
from tokenloom.sampling import Sampler, SamplingMetadata

LOGITS = np.array([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0])
DRAWS = 20000


def _softmax(x):
    e = np.exp(x - x.max())
    return e / e.sum()


def _draw(params: SamplingParams, logits=LOGITS, prompt=(), output=(), n=DRAWS) -> np.ndarray:
    meta = SamplingMetadata([params] * n, [list(prompt)] * n, [list(output)] * n, [None] * n, [frozenset()] * n)
    tokens = Sampler().sample(torch.tensor(logits, dtype=torch.float32).repeat(n, 1), meta).tokens
    return np.bincount(tokens.numpy(), minlength=len(logits))


def _assert_follows(counts: np.ndarray, expected: np.ndarray) -> None:
    support = expected > 0
    assert counts[~support].sum() == 0, f"drew tokens outside the support: {counts}"
    if support.sum() == 1:
        return  # a one-token support: the check above is the whole test
    _, p = chisquare(counts[support], expected[support] / expected.sum() * counts.sum())
    assert p > 1e-3, f"counts {counts} do not follow {expected.round(4)} (p={p:.2g})"


def _renorm(p, keep):
    q = np.where(keep, p, 0.0)
    return q / q.sum()


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_temperature(temperature):
    _assert_follows(_draw(SamplingParams(temperature=temperature)), _softmax(LOGITS / temperature))


@pytest.mark.parametrize("k", [1, 3, 5])
def test_top_k(k):
    p = _softmax(LOGITS)
    _assert_follows(_draw(SamplingParams(top_k=k)), _renorm(p, np.arange(len(p)) < k))


@pytest.mark.parametrize("top_p", [0.3, 0.6, 0.9])
def test_top_p(top_p):
    p = _softmax(LOGITS)  # LOGITS is sorted, so the nucleus is a prefix
    mass_before = np.concatenate([[0], np.cumsum(p)[:-1]])
    _assert_follows(_draw(SamplingParams(top_p=top_p)), _renorm(p, mass_before < top_p))


@pytest.mark.parametrize("top_p", [1e-9, 6.4e-146])  # the second reads as 0 in float32
def test_a_tiny_top_p_keeps_the_most_likely_token(top_p):
    """The nucleus is never empty: a top_p below every token's mass (even one that underflows
    float32) keeps the most likely token alone, alone in a batch or beside a top_k row."""
    counts = _draw(SamplingParams(top_p=top_p), n=200)
    assert counts[0] == 200
    for params in (SamplingParams(top_p=top_p, top_k=3), SamplingParams(top_p=top_p, top_k=40, min_p=0.05)):
        assert _draw(params, n=50)[0] == 50


@pytest.mark.parametrize("min_p", [0.1, 0.3])
def test_min_p(min_p):
    p = _softmax(LOGITS)
    _assert_follows(_draw(SamplingParams(min_p=min_p)), _renorm(p, p >= min_p * p.max()))


def test_temperature_then_top_k_then_top_p():
    p = _softmax(LOGITS / 0.7)
    keep = np.arange(len(p)) < 4
    q = _renorm(p, keep)
    mass_before = np.concatenate([[0], np.cumsum(q)[:-1]])
    _assert_follows(_draw(SamplingParams(temperature=0.7, top_k=4, top_p=0.8)), _renorm(q, mass_before < 0.8))


def test_repetition_penalty():
    # Token 0 (positive logit) seen in the prompt is divided, token 6 (negative) seen in output multiplied.
    penalized = LOGITS.copy()
    penalized[0] /= 1.5
    penalized[6] *= 1.5
    counts = _draw(SamplingParams(repetition_penalty=1.5), prompt=[0], output=[6])
    _assert_follows(counts, _softmax(penalized))


def test_frequency_and_presence_penalties():
    output = [1, 1, 1, 2]
    penalized = LOGITS.copy()
    penalized[1] -= 3 * 0.4 + 0.5
    penalized[2] -= 1 * 0.4 + 0.5
    counts = _draw(SamplingParams(frequency_penalty=0.4, presence_penalty=0.5), prompt=[3], output=output)
    _assert_follows(counts, _softmax(penalized))


def test_logit_bias():
    biased = LOGITS.copy()
    biased[7] += 5.0
    biased[0] -= 100
    _assert_follows(_draw(SamplingParams(logit_bias={7: 5.0, 0: -100.0})), _softmax(biased))


def test_greedy_takes_argmax_after_processors():
    counts = _draw(SamplingParams(temperature=0, logit_bias={3: 10.0}), n=10)
    assert counts[3] == 10


def test_min_tokens_bans_eos_and_stop_ids():
    params = SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[1])
    meta = SamplingMetadata([params], [[5]], [[4, 4]], [None], [frozenset({0})])
    tokens = Sampler().sample(torch.tensor(LOGITS[None], dtype=torch.float32), meta).tokens
    assert tokens.item() == 2  # 0 (EOS) and 1 (stop id) are banned, 2 is the next best


def test_seed_reproduces_and_ignores_batch_companions():
    def run(seed_rows, companions):
        params = [SamplingParams(seed=7)] + [SamplingParams()] * companions
        gens = [torch.Generator().manual_seed(7)] + [None] * companions
        n = len(params)
        meta = SamplingMetadata(params, [[]] * n, [[]] * n, gens, [frozenset()] * n)
        logits = torch.tensor(np.stack([LOGITS] * n), dtype=torch.float32)
        return [Sampler().sample(logits.clone(), meta).tokens[0].item() for _ in range(seed_rows)]

    # A fresh generator per run: the seeded row's draws depend only on its seed.
    assert run(1, 0) == run(1, 5)
    seq = [run(1, c)[0] for c in range(4)]
    assert len(set(seq)) == 1


def test_logprobs_are_raw_model_logprobs():
    params = SamplingParams(temperature=0, logprobs=3, logit_bias={5: 50.0})
    meta = SamplingMetadata([params], [[]], [[]], [None], [frozenset()])
    out = Sampler().sample(torch.tensor(LOGITS[None], dtype=torch.float32), meta)
    tokens, logprobs = out.tokens, out.logprobs
    raw = np.log(_softmax(LOGITS))
    assert tokens.item() == 5
    assert set(logprobs[0]) == {0, 1, 2, 5}  # top 3 plus the chosen token
    for t, lp in logprobs[0].items():
        assert lp == pytest.approx(raw[t], abs=1e-5)


def test_sampler_leaves_the_callers_logits_untouched():
    logits = torch.tensor(np.stack([LOGITS] * 2), dtype=torch.float32)
    before = logits.clone()
    params = [
        SamplingParams(temperature=0, logit_bias={3: 10.0}, min_tokens=2, stop_token_ids=[1]),
        SamplingParams(temperature=0.8, repetition_penalty=1.3, seed=1),
    ]
    meta = SamplingMetadata(
        params, [[0], [0]], [[], [2]], [None, torch.Generator().manual_seed(1)], [frozenset({0})] * 2
    )
    Sampler().sample(logits, meta)
    assert torch.equal(logits, before)


def test_row_argmax_is_argmax_including_ties_and_nan():
    from tokenloom.sampling.chain import row_argmax

    x = torch.randn(5, 1000, generator=torch.Generator().manual_seed(0))
    x[1, 10] = x[1, 20] = x[1, 30] = 50.0  # ties: the first index wins
    x[2] = 0.0  # a whole row tied
    x[3, 400] = float("inf")
    x[4, 7] = float("nan")  # NaN is the maximum, as for argmax
    assert torch.equal(row_argmax(x), x.argmax(dim=-1))
    assert row_argmax(x).tolist()[1:3] == [10, 0]


@pytest.mark.parametrize("width", [5, 33, 49152, 49157])
def test_row_argmax_kernel_is_argmax_across_its_column_ranges(width):
    """The fused kernel splits wide rows into one column range per thread: ties across the
    ranges, NaN in a later range, all -inf rows, -0.0 vs 0.0, short rows and tails."""
    from tokenloom.layers import fused
    from tokenloom.sampling.chain import row_argmax

    if not fused.build():
        pytest.skip("fused ops not built")
    g = torch.Generator().manual_seed(width)
    x = torch.randn(7, width, generator=g)
    last = width - 1
    x[0, 3] = x[0, last] = 9.0  # a tie between the first and the last range
    x[1, last] = float("nan")  # NaN in the last range beats any value
    x[2] = float("-inf")
    x[3] = 0.0
    x[3, 1::2] = -0.0  # equal to 0.0: the first index wins
    x[4, width // 2 :] = x[4, : width - width // 2].clone()  # every maximum twice
    x[5] = torch.randint(0, 2, (width,), generator=g).float()
    assert torch.equal(fused.row_argmax(x), x.argmax(dim=-1))
    narrower = x[:, 1:]  # rows apart by more than their width
    assert torch.equal(row_argmax(narrower), narrower.argmax(dim=-1))


def test_inverse_cdf_draw_follows_the_distribution_and_never_draws_a_zero():
    """Zeros first, between and last; a probability of 1e-6 among them; seeded and unseeded rows."""
    from tokenloom.sampling.sampler import inverse_cdf_draw

    p = torch.tensor([0.0, 0.3, 0.0, 1e-6, 0.2, 0.5 - 1e-6, 0.0, 0.0])
    n = DRAWS
    gens = [torch.Generator().manual_seed(i) if i % 2 else None for i in range(n)]
    counts = np.bincount(inverse_cdf_draw(p.repeat(n, 1), gens).numpy(), minlength=len(p))
    _assert_follows(counts, p.double().numpy())


def test_inverse_cdf_draw_at_the_top_of_u_takes_the_last_possible_token(monkeypatch):
    """u just below 1 (times a total that rounds) must not run past the last nonzero token."""
    from tokenloom.sampling import sampler

    p = torch.tensor([[0.25, 0.75, 0.0, 0.0], [0.1, 0.2, 0.3, 0.4]])
    monkeypatch.setattr(sampler.torch, "rand", lambda *a, **k: torch.full((a[0], 1), 1 - 2**-53, dtype=torch.float64))
    assert sampler.inverse_cdf_draw(p, [None, None]).tolist() == [1, 3]
