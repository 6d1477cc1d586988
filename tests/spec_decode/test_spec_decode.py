"""Speculative decoding is lossless: same greedy tokens, same sampling distribution, exact block accounting."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from scipy import stats

from tests.conftest import build_tiny_model
from tokenloom import LLM, SamplingParams
from tokenloom.config import SpeculativeConfig
from tokenloom.spec_decode.ngram import propose_ngram
from tokenloom.spec_decode.rejection import accept_greedy, accept_sampled


# ---- the pure pieces ---------------------------------------------------------------------------
def test_accept_greedy_keeps_matching_prefix_then_target_token():
    assert accept_greedy([5, 6, 7, 8], [5, 6, 7]) == [5, 6, 7, 8]  # all accepted + bonus
    assert accept_greedy([5, 9, 7, 8], [5, 6, 7]) == [5, 9]  # first mismatch: target's token
    assert accept_greedy([4, 6, 7, 8], [5, 6, 7]) == [4]
    assert accept_greedy([3], []) == [3]


def test_propose_ngram_copies_what_followed_the_latest_match():
    seq = [1, 2, 3, 4, 9, 1, 2, 3, 5, 6, 1, 2, 3]
    assert propose_ngram(seq, 2, 3, 1) == [5, 6]  # latest earlier "1 2 3" is followed by 5 6
    assert propose_ngram(seq, 9, 3, 1) == [5, 6, 1, 2, 3]  # shorter where the sequence runs out
    assert propose_ngram([7, 8, 9], 3, 3, 1) == []  # no earlier occurrence
    assert propose_ngram([1, 2, 9, 2], 2, 3, 1) == [9, 2]  # falls back to a 1-gram
    assert propose_ngram([1, 2, 9, 2], 2, 3, 2) == []


def _chi2_pvalue(samples: list[int], probs: torch.Tensor) -> float:
    counts = Counter(samples)
    support = [t for t in range(len(probs)) if probs[t] > 0]
    observed = [counts.get(t, 0) for t in support]
    assert sum(observed) == len(samples), "a token outside the target's support was emitted"
    expected = [float(probs[t]) * len(samples) for t in support]
    return stats.chisquare(observed, expected).pvalue


@pytest.mark.parametrize("deterministic_draft", [False, True])
def test_accept_sampled_output_is_target_distributed(deterministic_draft):
    gen = torch.Generator().manual_seed(0)
    V, k, trials = 6, 2, 20000
    p = torch.softmax(torch.randn(k + 1, V, generator=gen) * 1.5, -1)
    p[0, 5] = 0
    p[0] /= p[0].sum()  # a token the target never emits
    q = torch.softmax(torch.randn(k, V, generator=gen) * 1.5, -1)
    firsts, seconds = [], []
    for _ in range(trials):
        if deterministic_draft:
            drafts, q_arg = [2, 3], None
        else:
            drafts, q_arg = [int(torch.multinomial(q[j], 1, generator=gen)) for j in range(k)], q
        out = accept_sampled(p, drafts, q_arg, gen)
        assert 1 <= len(out) <= k + 1 and out[:-1] == drafts[: len(out) - 1]
        firsts.append(out[0])
        if len(out) >= 2:
            seconds.append(out[1])
    assert _chi2_pvalue(firsts, p[0]) > 1e-3
    assert len(seconds) > 1000 and _chi2_pvalue(seconds, p[1]) > 1e-3


# ---- end to end on the real model, greedy ------------------------------------------------------
TEXT = "The quick brown fox jumps over the lazy dog while the cat watches from the old wooden fence."
PROMPTS = [
    f"Repeat this sentence twice.\n{TEXT}\n{TEXT}\n",
    "def area(w, h):\n    return w * h\n\n\ndef area(",
    "Once upon a time",
]


@pytest.fixture(scope="module")
def plain_llm(default_model_dir):
    return LLM(str(default_model_dir), kv_cache_memory=128 << 20)


@pytest.fixture(scope="module")
def tiny_draft_for_default(default_model_dir, tmp_path_factory):
    """A random-weight 2-layer Llama with the default model's tokenizer: a draft that is mostly wrong."""
    from tests.helpers.draft_model import save_random_draft

    return save_random_draft(tmp_path_factory.mktemp("tiny_draft"), default_model_dir, vocab_size=49152)


def _spec_llm(default_model_dir, spec):
    return LLM(str(default_model_dir), kv_cache_memory=128 << 20, speculative=spec)


@pytest.fixture(scope="module")
def greedy_cases(plain_llm):
    """(params, plain outputs of PROMPTS) for each greedy case: computed once, compared against
    every proposer."""
    base = plain_llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=30))[0].outputs[0]
    stop = base.text[len(base.text) // 2 : len(base.text) // 2 + 4]  # lands inside an accepted run
    params = [  # each ends its own way: a stop string inside an accepted run, then max_tokens
        SamplingParams(temperature=0, max_tokens=30, stop=[stop]),
        SamplingParams(temperature=0, max_tokens=17, logprobs=2, repetition_penalty=1.2),
        SamplingParams(
            temperature=0,
            max_tokens=30,
            no_repeat_ngram_size=3,
            dry_multiplier=0.8,
            bad_words=["fox"],
            repetition_penalty_range=16,
            repetition_penalty=1.1,
        ),
    ]
    return [(p, [o.outputs[0] for o in plain_llm.generate(PROMPTS, p)]) for p in params]


@pytest.mark.parametrize("proposer", ["ngram", "draft_self", "draft_random"])
def test_greedy_speculation_is_token_identical(greedy_cases, default_model_dir, tiny_draft_for_default, proposer):
    spec = {
        "ngram": "ngram,k=4",
        "draft_self": f"draft={default_model_dir},k=3",
        "draft_random": f"draft={tiny_draft_for_default},k=3",
    }[proposer]
    llm = _spec_llm(default_model_dir, spec)
    for case, (p, expected) in enumerate(greedy_cases):
        batched = [o.outputs[0] for o in llm.generate(PROMPTS, p)]
        one = case % len(PROMPTS)  # each case runs one prompt alone too, a different one each time
        alone = llm.generate(PROMPTS[one], p)[0].outputs[0]
        assert alone.token_ids == batched[one].token_ids and alone.text == batched[one].text
        for e, b in zip(expected, batched):
            assert b.token_ids == e.token_ids and b.text == e.text
            assert b.finish_reason == e.finish_reason and b.stop_reason == e.stop_reason
            if p.logprobs is not None:
                for lb, le in zip(b.logprobs, e.logprobs):
                    assert lb.keys() == le.keys()
                    assert max(abs(lb[t] - le[t]) for t in lb) < 1e-3
    stats_ = llm.engine.stats()
    assert stats_.spec_draft_tokens > 0
    if proposer == "ngram":
        assert stats_.spec_accepted_tokens >= 10  # drafts accepted, not only rejected
    if proposer == "draft_self":
        assert stats_.spec_acceptance_rate > 0.9  # the target drafting for itself, greedy
    from tokenloom.entrypoints.server.metrics import ServerMetrics

    exported = ServerMetrics(llm.engine.stats).render().decode()
    assert f"tokenloom_spec_decode_accepted_tokens_total {float(stats_.spec_accepted_tokens)}" in exported
    assert f"tokenloom_spec_decode_acceptance_rate {stats_.spec_acceptance_rate}" in exported
    assert llm.engine.core.block_manager.num_used_blocks == 0
    llm.engine.core.block_manager.check_integrity()


def test_speculation_survives_preemption_and_keeps_blocks_exact(default_model_dir):
    prompts = [f"{i}: {TEXT} {TEXT}" for i in range(6)]  # distinct from the first block: no shared prefix
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    tiny_cache = 21 * 16 * 46080  # 20 blocks of 16 tokens (+ the null block) at 46080 B per token
    plain = LLM(str(default_model_dir), kv_cache_memory=tiny_cache)
    spec = LLM(str(default_model_dir), kv_cache_memory=tiny_cache, speculative="ngram,k=4,max_batch=16")
    expected = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    engine = spec.engine
    for i, p in enumerate(prompts):
        engine.add_request(str(i), engine.tokenizer.encode(p), params)
    done = {}
    while engine.has_unfinished_requests():
        for delta in engine.step():
            if delta.finished:
                done[delta.request_id] = delta.completion.token_ids
        engine.core.block_manager.check_integrity()
    assert [done[str(i)] for i in range(len(prompts))] == expected
    assert engine.core.scheduler.num_preemptions > 0 and engine.stats().spec_accepted_tokens > 0
    assert engine.core.block_manager.num_used_blocks == 0


# ---- sampling distribution end to end (tiny models: fast) --------------------------------------
@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    target = build_tiny_model("llama_gqa", tmp_path_factory.mktemp("target"), seed=0)
    draft = build_tiny_model("llama_gqa", tmp_path_factory.mktemp("draft"), seed=1)
    return target, draft


CHAIN = dict(
    temperature=0.9,
    top_n_sigma=2.5,
    typical_p=0.95,
    xtc_probability=0.5,
    xtc_threshold=0.02,
    epsilon_cutoff=1e-4,
    eta_cutoff=1e-3,
    no_repeat_ngram_size=3,
    dry_multiplier=0.5,
    dry_allowed_length=1,
    repetition_penalty=1.1,
)


@pytest.mark.parametrize(
    "method, min_accepted, chain",
    [
        ("draft_self", 500, "top_k"),
        ("draft_other", 0, "top_k"),
        ("ngram", 0, "top_k"),
        ("draft_self", 300, "every"),
        ("ngram", 0, "every"),
        ("draft_self", 300, "mirostat"),
    ],
)
def test_sampled_outputs_distributed_as_without_speculation(tiny_pair, method, min_accepted, chain):
    """draft_self accepts nearly everything (p == q); draft_other and n-gram drafts (a random tiny model
    does not copy) are nearly all rejected, so the residual draw runs. The deterministic-draft accept
    branch is checked against its distribution in test_accept_sampled_output_is_target_distributed.
    "every": every processor and filter at once; "mirostat": mu moves with each accepted draft."""
    target, other = tiny_pair
    draft = {"draft_self": str(target), "draft_other": str(other), "ngram": None}[method]
    spec = SpeculativeConfig(
        "ngram" if draft is None else "draft", k=2, draft_model=draft, max_batch=10_000, min_acceptance=0.0
    )
    settings = {
        "top_k": dict(temperature=0.5, top_k=8),
        "every": CHAIN,
        "mirostat": dict(mirostat=2, mirostat_tau=2.0, mirostat_eta=0.5),
    }[chain]
    plain = LLM(str(target), kv_cache_memory=64 << 20)
    specd = LLM(str(target), kv_cache_memory=64 << 20, speculative=spec)
    prompt = list(range(100, 240))  # most sampled tokens occur in it, so the n-gram proposer drafts
    n = 1500
    params = [SamplingParams(**settings, max_tokens=3, seed=s, ignore_eos=True) for s in range(n)]
    a = [o.outputs[0].token_ids for o in plain.generate([prompt] * n, params)]
    b = [o.outputs[0].token_ids for o in specd.generate([prompt] * n, params)]
    s_ = specd.engine.stats()
    assert s_.spec_draft_tokens >= n // 3 and s_.spec_accepted_tokens >= min_accepted, s_
    for position in range(3):
        ca, cb = Counter(x[position] for x in a), Counter(x[position] for x in b)
        tokens = sorted(set(ca) | set(cb))
        common = [t for t in tokens if ca[t] + cb[t] >= 10]
        rest = [t for t in tokens if t not in common]
        table = [
            [ca[t] for t in common] + [sum(ca[t] for t in rest)],
            [cb[t] for t in common] + [sum(cb[t] for t in rest)],
        ]
        if table[0][-1] + table[1][-1] == 0:
            table = [row[:-1] for row in table]
        assert stats.chi2_contingency(table).pvalue > 1e-3, (position, table)
    assert specd.engine.core.block_manager.num_used_blocks == 0


def test_bad_speculative_configs_are_clear_errors(default_model_dir, tiny_pair):
    with pytest.raises(ValueError, match="ngram' or 'draft"):
        SpeculativeConfig.parse("eagle,k=2")
    with pytest.raises(ValueError, match="share the target's tokenizer"):
        LLM(str(default_model_dir), kv_cache_memory=64 << 20, speculative=f"draft={tiny_pair[1]},k=2")
