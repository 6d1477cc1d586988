"""The sampler chain against its references, on random logits and histories.

HF transformers' own processors where it has one (no_repeat_ngram, typical, epsilon, eta, bad
words); a plain, loop-by-loop restatement of llama.cpp's C++ otherwise (DRY, XTC, top-n-sigma,
mirostat); chi-square tests that draws follow the distribution the chain claims; and the same
numbers for a row in a mixed batch as alone.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy.stats import chisquare
from transformers.generation import logits_process as hf

from tokenloom import SamplingParams
from tokenloom.sampling import Sampler, SamplingMetadata
from tokenloom.sampling.chain import sampling_distribution
from tokenloom.sampling.dry import DryBreakers
from tokenloom.sampling.processors import apply_processors
from tokenloom.sampling.state import SamplingState

V = 64


def _logits(rows: int, seed: int, banned: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, V, generator=g) * 3
    if banned:
        x[:, torch.randperm(V, generator=g)[:banned]] = float("-inf")
    return x


def _histories(rows: int, seed: int, alphabet: int = 6, longest: int = 60) -> list[list[int]]:
    """Short-alphabet histories: full of repeated n-grams."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, alphabet, size=int(rng.integers(1, longest))).tolist() for _ in range(rows)]


def _meta(
    params: list[SamplingParams], histories: list[list[int]] | None = None, states: list[SamplingState] | None = None
) -> SamplingMetadata:
    """Rows whose history is split into prompt (first half) and output (second half)."""
    histories = histories or [[] for _ in params]
    prompts = [h[: len(h) // 2] for h in histories]
    outputs = [h[len(h) // 2 :] for h in histories]
    n = len(params)
    return SamplingMetadata(params, prompts, outputs, [None] * n, [frozenset()] * n, states)


def _same_support(ours: torch.Tensor, reference: torch.Tensor) -> None:
    """Equal -inf masks, and the kept logits untouched."""
    assert torch.equal(torch.isinf(ours), torch.isinf(reference))
    kept = torch.isfinite(reference)
    assert torch.equal(ours[kept], reference[kept])


# ---- processors against HF's own ---------------------------------------------------------------
def test_no_repeat_ngram_equals_hf_for_each_row_of_a_mixed_batch():
    histories = _histories(12, seed=1)
    sizes = [0, 1, 2, 3, 4, 2, 3, 5, 1, 3, 2, 4]
    logits = _logits(12, seed=2)
    ours = apply_processors(logits, _meta([SamplingParams(no_repeat_ngram_size=n) for n in sizes], histories))
    for i, (n, h) in enumerate(zip(sizes, histories)):
        expected = logits[i : i + 1].clone()
        if n:
            expected = hf.NoRepeatNGramLogitsProcessor(n)(torch.tensor([h]), expected)
        _same_support(ours[i : i + 1], expected)
    assert torch.isinf(ours).sum() > 20  # the histories repeat: plenty was banned


def test_bad_words_equal_hf_for_each_row():
    histories = [[1, 2, 3], [5, 1, 2], [7, 7, 9, 4], [3], [2, 9, 4, 8]]
    words = [[[10]], [[1, 2, 11], [2, 12]], [[9, 4, 13], [4, 14, 15], [20]], [[3, 16]], [[4, 8, 17], [8, 18]]]
    logits = _logits(5, seed=3)
    states = [SamplingState(bad_words_ids=w) for w in words]
    params = [SamplingParams(bad_words=["set"]) for _ in words]
    ours = apply_processors(logits, _meta(params, histories, states))
    for i, (h, w) in enumerate(zip(histories, words)):
        expected = hf.NoBadWordsLogitsProcessor(w, eos_token_id=V - 1)(torch.tensor([h]), logits[i : i + 1].clone())
        _same_support(ours[i : i + 1], expected)
    assert torch.isinf(ours[1, [11, 12]]).all() and not torch.isinf(ours[1, 13])


def test_repetition_penalty_range_sees_only_the_last_tokens():
    params = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, repetition_penalty_range=3)
    logits = torch.full((1, V), 1.0)
    meta = SamplingMetadata([params], [[7, 8]], [[9, 9, 10]], [None], [frozenset()])  # last 3: 9 9 10
    out = apply_processors(logits, meta)[0]
    assert out[7] == out[8] == 1.0  # out of range: untouched
    assert out[9] == pytest.approx(0.5 - 2 * 0.5) and out[10] == pytest.approx(0.5 - 0.5)
    wide = SamplingMetadata([SamplingParams(repetition_penalty=2.0)], [[7, 8]], [[9]], [None], [frozenset()])
    assert apply_processors(logits, wide)[0, 7] == 0.5  # range 0: the whole history


# ---- filters against HF's warpers --------------------------------------------------------------
@pytest.mark.parametrize(
    "name, warper, values",
    [
        ("typical_p", lambda v: hf.TypicalLogitsWarper(mass=v), [0.2, 0.5, 0.9, 0.95, 1.0]),
        ("epsilon_cutoff", lambda v: hf.EpsilonLogitsWarper(epsilon=v), [1e-4, 3e-3, 0.02, 0.1, 0.0]),
        ("eta_cutoff", lambda v: hf.EtaLogitsWarper(epsilon=v), [1e-4, 3e-3, 0.02, 0.2, 0.0]),
    ],
)
def test_truncation_filters_equal_hf_warpers_row_by_row(name, warper, values):
    logits = _logits(len(values), seed=4, banned=5)
    params = [SamplingParams(**{name: v}) for v in values]
    probs = sampling_distribution(logits, _meta(params))
    for i, v in enumerate(values):
        expected = logits[i : i + 1] if v in (0.0, 1.0) else warper(v)(None, logits[i : i + 1].clone())
        torch.testing.assert_close(probs[i : i + 1], expected.softmax(-1))
        assert torch.equal(probs[i] > 0, torch.isfinite(expected[0]))
    assert (probs[:-1] == 0).sum() > (probs[-1] == 0).sum()  # the filters did cut


# ---- llama.cpp's samplers, restated loop by loop -----------------------------------------------
def _softmax_sorted(logits: list[float]) -> list[tuple[int, float]]:
    """(token, p) sorted by logit, descending (llama_sampler_softmax_impl)."""
    order = sorted(range(len(logits)), key=lambda t: -logits[t])
    top = logits[order[0]]
    weights = [math.exp(logits[t] - top) if logits[t] != -math.inf else 0.0 for t in order]
    total = sum(weights)
    return [(t, w / total) for t, w in zip(order, weights)]


def _ref_top_n_sigma(logits: list[float], n: float) -> set[int]:
    finite = [x for x in logits if x != -math.inf]
    mean = sum(finite) / len(finite)
    std = math.sqrt(sum((x - mean) ** 2 for x in finite) / len(finite))
    return {t for t, x in enumerate(logits) if x != -math.inf and x >= max(finite) - n * std}


def test_top_n_sigma_equals_llama_cpp():
    values = [0.5, 1.0, 2.0, 0.0]
    logits = _logits(len(values), seed=5, banned=4)
    probs = sampling_distribution(logits, _meta([SamplingParams(top_n_sigma=v) for v in values]))
    for i, n in enumerate(values):
        kept = (
            set(range(V)) - {t for t in range(V) if logits[i, t] == -math.inf}
            if n == 0
            else _ref_top_n_sigma(logits[i].tolist(), n)
        )
        assert {t for t in range(V) if probs[i, t] > 0} == kept
    assert (probs[0] > 0).sum() < (probs[2] > 0).sum() < (probs[3] > 0).sum()


def _ref_xtc_cut(logits: list[float], threshold: float) -> list[float]:
    """llama.cpp's XTC once it fires: drop the sorted prefix above threshold but its last token."""
    ranked = _softmax_sorted(logits)
    pos_last = 0
    for i, (_, p) in enumerate(ranked):
        if p >= threshold:
            pos_last = i
        else:
            break
    out = list(logits)
    if pos_last > 0:
        for t, _ in ranked[:pos_last]:
            out[t] = -math.inf
    return out


def test_xtc_is_the_mixture_of_llama_cpp_cut_and_uncut():
    cases = [(0.5, 0.05), (1.0, 0.03), (0.3, 0.2), (0.7, 0.5), (0.0, 0.1)]
    logits = _logits(len(cases), seed=6) / 2
    params = [SamplingParams(xtc_probability=p, xtc_threshold=t) for p, t in cases]
    probs = sampling_distribution(logits, _meta(params))
    for i, (chance, threshold) in enumerate(cases):
        cut = torch.tensor(_ref_xtc_cut(logits[i].tolist(), threshold)).softmax(-1)
        expected = (1 - chance) * logits[i].softmax(-1) + chance * cut
        torch.testing.assert_close(probs[i], expected)
    assert probs[1, logits[1].argmax()] == 0  # probability 1: the top is always cut


def _ref_mirostat(logits: list[float], mu: float, version: int) -> dict[int, float]:
    """llama.cpp's mirostat / mirostat_v2 truncation, renormalized: {token: p}."""
    ranked = _softmax_sorted(logits)
    if version == 2:
        size = next((i for i, (_, p) in enumerate(ranked) if -math.log2(p) > mu), len(ranked)) if ranked else 0
        kept = ranked[: max(size, 1)]
    else:
        sum_ti_bi = sum_ti_sq = 0.0
        for i in range(min(99, len(ranked) - 1)):
            t_i = math.log((i + 2) / (i + 1))
            b_i = math.log(ranked[i][1] / ranked[i + 1][1])
            sum_ti_bi += t_i * b_i
            sum_ti_sq += t_i * t_i
        s_hat = sum_ti_bi / sum_ti_sq
        eps_hat = s_hat - 1
        k = ((eps_hat * 2**mu) / (1 - len(logits) ** -eps_hat)) ** (1 / s_hat)
        kept = ranked[: max(int(k), 1)]
    total = sum(p for _, p in kept)
    return {t: p / total for t, p in kept}


@pytest.mark.parametrize("version", [1, 2])
def test_mirostat_equals_llama_cpp_and_moves_mu_by_the_surprise(version):
    taus = [3.0, 5.0, 8.0, 1.0]
    logits = _logits(len(taus), seed=7 + version) / 1.5
    params = [
        SamplingParams(mirostat=version, mirostat_tau=t, mirostat_eta=0.2, temperature=0.9, top_k=3) for t in taus
    ]  # top_k is replaced by mirostat, as in llama.cpp
    states = [SamplingState.initial(p) for p in params]
    meta = _meta(params, states=states)
    probs = sampling_distribution(logits.clone(), meta)
    expected = [_ref_mirostat((logits[i] / 0.9).tolist(), 2 * t, version) for i, t in enumerate(taus)]
    for i, ref in enumerate(expected):
        assert {t for t in range(V) if probs[i, t] > 0} == set(ref)
        for t, p in ref.items():
            assert float(probs[i, t]) == pytest.approx(p, rel=1e-4)
    chosen = Sampler().sample(logits.clone(), meta).tokens.tolist()
    for i, (tau, token) in enumerate(zip(taus, chosen)):
        surprise = -math.log2(expected[i][token])
        assert states[i].mirostat_mu == pytest.approx(2 * tau - 0.2 * (surprise - tau), rel=1e-6)


def _ref_dry(context: list[int], p: SamplingParams, breakers: dict[int, list[list[int]]]) -> dict[int, float]:
    """llama_sampler_dry_apply, line by line: {token: penalty}."""
    last_n = len(context) if p.dry_penalty_last_n == -1 else min(len(context), p.dry_penalty_last_n)
    rat = lambda i: context[len(context) - 1 - i]  # noqa: E731 (the ring buffer's "from the end")
    if last_n <= p.dry_allowed_length:
        return {}
    rep_limit = last_n
    for i in range(last_n):
        longest = -1
        for tail in breakers.get(rat(i), []):
            if longest < len(tail) <= i and all(tail[o] == rat(i - o - 1) for o in range(len(tail))):
                longest = len(tail)
        if longest >= 0:
            rep_limit = i - longest
            break
    if rep_limit < p.dry_allowed_length:
        return {}
    count = [0] * last_n
    last = last_n - 1
    for k in range(1, last_n):  # the reversed Z-array, as plainly as it gets
        n = 0
        while n + k < last_n and rat(n) == rat(n + k):
            n += 1
        count[last - k] = min(n, rep_limit)
    longest_for: dict[int, int] = {}
    for i in range(last_n - 1):
        if count[i] >= p.dry_allowed_length:
            token = rat(last_n - 2 - i)
            longest_for[token] = max(longest_for.get(token, 0), count[i])
    max_exponent = int(88.7228391 / math.log(p.dry_base)) if p.dry_base > 1.000001 else 0
    penalties = {}
    for token, length in longest_for.items():
        if [] in breakers.get(token, []):
            continue
        exponent = length - p.dry_allowed_length
        if max_exponent > 0:
            exponent = min(exponent, max_exponent)
        penalties[token] = p.dry_multiplier * p.dry_base**exponent
    return penalties


def _breakers(tails: dict[int, list[list[int]]]) -> DryBreakers:
    single, heads = torch.zeros(V, dtype=torch.bool), torch.zeros(V, dtype=torch.bool)
    for token, found in tails.items():
        heads[token] = True
        single[token] = [] in found
    return DryBreakers(single, heads, {t: tuple(tuple(x) for x in f) for t, f in tails.items()})


def test_dry_equals_llama_cpp_for_each_row_of_a_mixed_batch():
    rng = np.random.default_rng(8)
    contexts = [rng.choice([1, 2, 3, 5], size=int(rng.integers(60, 200))).tolist() for _ in range(6)]
    contexts += [c[:40] + [0] + c[40:] for c in contexts[:2]]  # a breaker (0) far back
    contexts.append([1, 2, 3, 5] * 30)  # one long loop: clamped exponent
    contexts.append([1, 2, 3, 7, 4, 1, 2, 3])  # breaker 4 1 mid-repeat
    tails = {0: [[]], 4: [[1]]}  # 0 alone; 4 followed by 1
    params = [
        SamplingParams(dry_multiplier=m, dry_base=b, dry_allowed_length=a, dry_penalty_last_n=n)
        for m, b, a, n in [
            (0.8, 1.75, 2, -1),
            (1.0, 1.1, 3, 50),
            (0.5, 2.0, 1, -1),
            (0.8, 1.75, 2, 10),
            (2.0, 1.0, 2, -1),
            (0.8, 1.75, 4, -1),
            (0.8, 3.0, 2, 64),
            (0.3, 1.5, 2, -1),
            (1.0, 3.0, 2, -1),
            (1.0, 1.75, 2, -1),
        ]
    ]
    states = [SamplingState(dry_breakers=_breakers(tails)) for _ in params]
    logits = torch.zeros(len(params), V)
    out = apply_processors(logits, _meta(params, contexts, states))
    for i, (context, p) in enumerate(zip(contexts, params)):
        expected = torch.zeros(V)
        for token, penalty in _ref_dry(context, p, tails).items():
            expected[token] = -penalty
        torch.testing.assert_close(out[i], expected, rtol=1e-5, atol=1e-6)
    assert (out != 0).any(-1).sum() >= 8 and out[8].min() == -(3.0**80)  # most rows penalized; one clamped
    assert out[9].nonzero().flatten().tolist() == [7]  # the repeat reaches back to 4 1 only


def test_dry_breakers_from_token_texts_follow_llama_cpp():
    texts = ["a", "b", "\n", "x\ny", "ca", "b c", "ab", "q"]
    encode = {"b": [1], "\n": [2]}.__getitem__
    found = DryBreakers.build(["\n", "ab"], texts, encode)
    # tokens holding a breaker break alone; "ca" and "a" end with "a", which "b" (token 1) completes
    assert found.single.nonzero().flatten().tolist() == [2, 3, 6]
    assert found.tails[4] == ((1,),) and found.tails[0] == ((1,),)
    assert found.repeat_limit([7, 7, 0, 1, 7, 7]) == 2  # "a" "b" ends 2 tokens back
    assert found.repeat_limit([7, 0, 7, 7, 7]) == 5  # a head whose tail is absent


# ---- draws follow the claimed distribution ---------------------------------------------------
SMALL = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0])
DRAWS = 20000


def _draws(params: SamplingParams) -> np.ndarray:
    torch.manual_seed(0)  # unseeded rows draw from torch's own stream
    meta = _meta([params] * DRAWS)
    tokens = Sampler().sample(SMALL.repeat(DRAWS, 1), meta).tokens
    return np.bincount(tokens.numpy(), minlength=len(SMALL))


def _numpy_softmax(x):
    e = np.exp(x - x[np.isfinite(x)].max())
    return e / e.sum()


def _expected_small(params: SamplingParams) -> np.ndarray:
    """The distribution of SMALL under one filter, restated in numpy (SMALL is sorted descending)."""
    x = SMALL.numpy().astype(np.float64) / params.temperature
    p = _numpy_softmax(x)
    if params.typical_p < 1:
        entropy = -(p * np.log(p)).sum()
        order = np.argsort(np.abs(-np.log(p) - entropy), kind="stable")
        mass, keep = 0.0, []
        for t in order:
            keep.append(t)
            mass += p[t]
            if mass >= params.typical_p:
                break
        x = np.where(np.isin(np.arange(len(x)), keep), x, -np.inf)
    if params.top_n_sigma:
        x = np.where(x >= x.max() - params.top_n_sigma * x.std(), x, -np.inf)
    if params.epsilon_cutoff:
        x = np.where((p >= params.epsilon_cutoff) | (np.arange(len(x)) == 0), x, -np.inf)
    if params.xtc_probability:
        cut = np.where(
            (p >= params.xtc_threshold) & (np.arange(len(x)) < (p >= params.xtc_threshold).sum() - 1), -np.inf, x
        )
        return (1 - params.xtc_probability) * _numpy_softmax(x) + params.xtc_probability * _numpy_softmax(cut)
    return _numpy_softmax(x)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(typical_p=0.6),
        SamplingParams(typical_p=0.9, temperature=1.5),
        SamplingParams(top_n_sigma=1.0),
        SamplingParams(epsilon_cutoff=0.05),
        SamplingParams(xtc_probability=0.5, xtc_threshold=0.1),
        SamplingParams(xtc_probability=1.0, xtc_threshold=0.15, temperature=0.7),
    ],
    ids=lambda p: ",".join(
        f"{k}={getattr(p, k)}" for k in ("typical_p", "top_n_sigma", "epsilon_cutoff", "xtc_probability", "temperature")
    ),
)
def test_draws_follow_the_distribution_the_chain_claims(params):
    counts, expected = _draws(params), _expected_small(params)
    support = expected > 0
    assert counts[~support].sum() == 0
    _, pvalue = chisquare(counts[support], expected[support] * DRAWS)
    assert pvalue > 1e-3, (counts, expected.round(4))


def test_llama_cpp_order_applies_temperature_after_top_p():
    """samplers=top_p;temperature (llama.cpp's default order) cuts on the model's own probabilities."""
    late = SamplingParams(temperature=3.0, top_p=0.6, samplers="top_k;top_p;min_p;temperature")
    early = SamplingParams(temperature=3.0, top_p=0.6)
    probs = sampling_distribution(SMALL.repeat(2, 1), _meta([late, early]))
    p = _numpy_softmax(SMALL.numpy().astype(np.float64))
    nucleus = np.concatenate([[0], np.cumsum(p)[:-1]]) < 0.6  # sorted: a prefix
    x = np.where(nucleus, SMALL.numpy() / 3.0, -np.inf)
    np.testing.assert_allclose(probs[0].numpy(), _numpy_softmax(x), rtol=1e-5)
    assert (probs[1] > 0).sum() > (probs[0] > 0).sum()  # tempering first widens the nucleus


# ---- a mixed batch == each row alone -----------------------------------------------------------
MIXED = [
    SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=1),
    SamplingParams(typical_p=0.7, min_p=0.02, seed=2),
    SamplingParams(top_n_sigma=1.5, xtc_probability=0.5, xtc_threshold=0.05, seed=3),
    SamplingParams(epsilon_cutoff=0.01, eta_cutoff=0.005, samplers=["eta_cutoff", "temperature"], seed=4),
    SamplingParams(mirostat=2, mirostat_tau=4.0, seed=5),
    SamplingParams(mirostat=1, seed=6, no_repeat_ngram_size=2),
    SamplingParams(temperature=0, dry_multiplier=0.8, no_repeat_ngram_size=3),
    SamplingParams(
        dry_multiplier=1.0, dry_allowed_length=3, repetition_penalty=1.3, repetition_penalty_range=16, seed=7
    ),
    SamplingParams(bad_words=["x"], top_p=0.5, samplers="top_p;temperature", temperature=1.4, seed=8),
]


def _mixed_states() -> list[SamplingState]:
    states = [SamplingState.initial(p) for p in MIXED]
    for p, s in zip(MIXED, states):
        if p.dry_multiplier:
            s.dry_breakers = _breakers({0: [[]]})
        if p.bad_words:
            s.bad_words_ids = [[3], [1, 2]]
    return states


def test_a_row_in_a_mixed_batch_samples_as_it_would_alone():
    logits = _logits(len(MIXED), seed=9)
    histories = _histories(len(MIXED), seed=10, alphabet=8)

    def run(rows: list[int]):
        states = _mixed_states()
        meta = SamplingMetadata(
            [MIXED[i] for i in rows],
            [histories[i][:5] for i in rows],
            [histories[i][5:] for i in rows],
            [torch.Generator().manual_seed(i) for i in rows],
            [frozenset()] * len(rows),
            [states[i] for i in rows],
        )
        processed = apply_processors(logits[rows], meta)
        sampled = [j for j, i in enumerate(rows) if not MIXED[i].greedy]
        probs = sampling_distribution(processed[sampled], meta.rows(sampled)) if sampled else None
        tokens = Sampler().sample(logits[rows], meta).tokens.tolist()
        return processed, probs, tokens, [s.mirostat_mu for s in meta.states]

    together = run(list(range(len(MIXED))))
    sampled = [i for i, p in enumerate(MIXED) if not p.greedy]
    for i in range(len(MIXED)):
        alone = run([i])
        torch.testing.assert_close(alone[0][0], together[0][i])
        if not MIXED[i].greedy:
            torch.testing.assert_close(alone[1][0], together[1][sampled.index(i)])
        assert alone[2][0] == together[2][i] and alone[3][0] == together[3][i]
    assert len({tuple(row.gt(0).nonzero().flatten().tolist()) for row in together[1]}) == len(sampled)


# ---- the params --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"typical_p": 0.0}, "typical_p"),
        ({"top_n_sigma": -2.0}, "top_n_sigma"),
        ({"epsilon_cutoff": 1.0}, "epsilon_cutoff"),
        ({"eta_cutoff": -0.1}, "eta_cutoff"),
        ({"xtc_probability": 1.5}, "xtc_probability"),
        ({"xtc_threshold": -0.1}, "xtc_threshold"),
        ({"mirostat": 3}, "mirostat"),
        ({"mirostat_tau": 0.0}, "mirostat_tau"),
        ({"mirostat_eta": 0.0}, "mirostat_eta"),
        ({"no_repeat_ngram_size": -1}, "no_repeat_ngram_size"),
        ({"bad_words": [" "]}, "bad_words"),
        ({"repetition_penalty_range": -5}, "repetition_penalty_range"),
        ({"dry_multiplier": -1.0}, "dry_multiplier"),
        ({"dry_base": 0.5}, "dry_base"),
        ({"dry_allowed_length": 0}, "dry_allowed_length"),
        ({"dry_penalty_last_n": -2}, "dry_penalty_last_n"),
        ({"dry_sequence_breakers": [""]}, "dry_sequence_breakers"),
        ({"samplers": ["top_k", "top_q"]}, "samplers"),
        ({"samplers": ["top_k", "top_k"]}, "samplers"),
        ({"samplers": ["top_k", "dry"]}, "samplers"),
    ],
)
def test_out_of_range_chain_settings_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"SamplingParams.{field} "):
        SamplingParams(**kwargs)


def test_samplers_take_llama_cpp_names_and_leading_processors():
    p = SamplingParams(samplers="penalties;dry;top_n_sigma;top_k;typ_p;top_p;min_p;xtc;temp")
    assert p.sampler_order == ("top_n_sigma", "top_k", "typical_p", "top_p", "min_p", "xtc", "temperature")
    assert SamplingParams(top_n_sigma=-1).top_n_sigma == 0


def test_a_seeded_row_draws_the_same_token_whether_its_batch_narrows_or_not():
    """Alone, a peaked row's nucleus lies in its top 256 tokens and the chain narrows to those; beside a
    flat row (nucleus of thousands) it runs over the whole vocabulary. The seeded draws must agree."""
    g = torch.Generator().manual_seed(11)
    peaked, flat = torch.randn(1, 5000, generator=g) * 4, torch.randn(1, 5000, generator=g) * 0.01
    params = SamplingParams(top_p=0.9, seed=0)
    for seed in range(40):

        def draw(logits, seed=seed):
            n = logits.shape[0]
            meta = SamplingMetadata(
                [params] * n,
                [[]] * n,
                [[]] * n,
                [torch.Generator().manual_seed(seed) for _ in range(n)],
                [frozenset()] * n,
            )
            return Sampler().sample(logits, meta).tokens[0].item()

        assert draw(peaked) == draw(torch.cat([peaked, flat]))
