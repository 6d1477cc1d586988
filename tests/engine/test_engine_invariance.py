"""Invariance on the real model, greedy, float32: how a request is scheduled must not change its tokens."""

from __future__ import annotations

import pytest

from tokenloom import LLM, SamplingParams

TARGET = "The three primary colors are"
OTHERS = [
    "Once upon a time, there was a little",
    "def fibonacci(n):",
    "Paris is",
    "1, 2, 3, 4,",
    "The quick brown fox jumps over the lazy dog. " * 6,
    "Q: What is 2+2?\nA:",
    "In 1492,",
    "Dear Sir or Madam, I am writing to",
    "import numpy as np\nimport torch\n",
    "The mitochondria is",
    "Roses are red,",
    "A B C D E F G",
    "My favourite food is " * 3,
    "<html><body>",
    "Water boils at",
    "The capital of Japan is",
]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=0)


def tokens_and_logprobs(out):
    c = out.outputs[0]
    return c.token_ids, [lp[t] for lp, t in zip(c.logprobs, c.token_ids)]


def assert_same(a, b):
    assert a[0] == b[0]
    assert a[1] == pytest.approx(b[1], abs=1e-4)


@pytest.fixture(scope="module")
def make_llm(default_model_dir):
    def make(**kwargs):
        kwargs.setdefault("kv_cache_memory", 128 << 20)
        return LLM(str(default_model_dir), **kwargs)

    return make


@pytest.fixture(scope="module")
def alone(make_llm):
    return tokens_and_logprobs(make_llm(enable_prefix_caching=False).generate(TARGET, GREEDY)[0])


def test_alone_equals_among_16_others(make_llm, alone):
    llm = make_llm()
    params = [SamplingParams(temperature=0, max_tokens=8 + 3 * i, ignore_eos=True) for i in range(len(OTHERS))]
    for i, (p, sp) in enumerate(zip(OTHERS, params)):
        llm.engine.add_request(f"other{i}", llm.tokenizer.encode(p), sp)
    out = llm.generate(TARGET, GREEDY)[0]  # joins a batch of 16 running requests
    assert_same(tokens_and_logprobs(out), alone)


@pytest.mark.parametrize("chunk", [3, 7, 16])
def test_chunked_prefill_equals_whole(make_llm, alone, chunk):
    llm = make_llm(max_num_batched_tokens=chunk, enable_prefix_caching=False)
    assert_same(tokens_and_logprobs(llm.generate(TARGET, GREEDY)[0]), alone)


def test_prefix_cache_hit_equals_miss(make_llm):
    system = "You are a helpful assistant who answers in one short sentence about geography. " * 3
    miss_llm = make_llm(enable_prefix_caching=False)
    hit_llm = make_llm()
    first = hit_llm.generate(system + "Where is Peru?", GREEDY)[0]
    hit = hit_llm.generate(system + "Where is Kenya?", GREEDY)[0]
    common = next(i for i, (a, b) in enumerate(zip(first.prompt_token_ids, hit.prompt_token_ids)) if a != b)
    assert common >= 32
    assert hit.outputs[0].metrics.num_cached_prompt_tokens == common // 16 * 16  # the full shared blocks
    miss = miss_llm.generate(system + "Where is Kenya?", GREEDY)[0]
    assert miss.outputs[0].metrics.num_cached_prompt_tokens == 0
    assert_same(tokens_and_logprobs(hit), tokens_and_logprobs(miss))


def test_partial_block_hit_and_its_copy_equal_a_miss(make_llm):
    """Two requests continuing a finished one mid-block: one takes its last block over, the
    other writes into a copy of it; both must match requests computed from scratch."""
    hit_llm = make_llm()
    miss_llm = make_llm(enable_prefix_caching=False)
    first = miss_llm.generate(TARGET, GREEDY)[0]
    base = first.prompt_token_ids + first.outputs[0].token_ids[:20]  # 1 full block + 9 tokens
    assert len(base) % 16 not in (0, 15)
    hit_llm.generate([base], SamplingParams(temperature=0, max_tokens=1))
    continuations = [base + [first.outputs[0].token_ids[20]], base + [11]]
    hits = hit_llm.generate(continuations, GREEDY)
    misses = miss_llm.generate(continuations, GREEDY)
    stats = hit_llm.engine.core.block_manager.stats
    assert (stats.partial_hits, stats.copied_blocks) == (2, 1)
    for hit, miss in zip(hits, misses):
        assert hit.outputs[0].metrics.num_cached_prompt_tokens == len(base)
        assert_same(tokens_and_logprobs(hit), tokens_and_logprobs(miss))
    hit_llm.engine.core.block_manager.check_integrity()


def test_preempted_equals_uninterrupted(make_llm):
    prompts = [TARGET, OTHERS[0], OTHERS[2], OTHERS[7]]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=0)
    roomy = make_llm().generate(prompts, params)
    # 10 blocks of 16 tokens: each request needs 3-4 blocks at the end, so some must be preempted.
    tiny = make_llm(kv_cache_memory=10 * 16 * 46080, enable_prefix_caching=False)
    cramped = tiny.generate(prompts, params)
    assert tiny.engine.stats().num_preemptions > 0
    assert sum(o.outputs[0].metrics.num_preemptions for o in cramped) > 0
    for a, b in zip(cramped, roomy):
        assert_same(tokens_and_logprobs(a), tokens_and_logprobs(b))
    assert tiny.engine.core.block_manager.num_free_blocks == tiny.engine.core.block_manager.num_blocks


def test_paged_equals_contiguous(make_llm):
    prompts = [TARGET, OTHERS[1], OTHERS[4]]
    paged = make_llm(block_size=4).generate(prompts, GREEDY)
    contiguous = make_llm(block_size=1024).generate(prompts, GREEDY)  # one block per request
    for a, b in zip(paged, contiguous):
        assert_same(tokens_and_logprobs(a), tokens_and_logprobs(b))


def test_mixed_params_in_one_batch_equal_each_alone(make_llm):
    llm = make_llm(enable_prefix_caching=False)
    cases = [
        (TARGET, SamplingParams(temperature=0, max_tokens=12, logprobs=3)),
        (OTHERS[0], SamplingParams(temperature=0.9, top_p=0.9, seed=11, max_tokens=12)),
        (OTHERS[2], SamplingParams(temperature=0, max_tokens=30, stop=[" France"])),
        (OTHERS[3], SamplingParams(temperature=1.3, top_k=20, seed=5, max_tokens=12, repetition_penalty=1.2)),
    ]
    alone = [llm.generate(p, sp)[0].outputs[0] for p, sp in cases]
    for i, (p, sp) in enumerate(cases):
        llm.engine.add_request(f"mixed{i}", llm.tokenizer.encode(p), sp)
    together = {}
    while llm.engine.has_unfinished_requests():
        for d in llm.engine.step():
            if d.finished:
                together[d.request_id] = d.completion
    for i, a in enumerate(alone):
        b = together[f"mixed{i}"]
        assert (b.token_ids, b.text, b.finish_reason) == (a.token_ids, a.text, a.finish_reason)
        if a.logprobs:
            assert [sorted(d) for d in b.logprobs] == [sorted(d) for d in a.logprobs]


def test_no_blocks_leak_after_finish_and_abort(make_llm):
    llm = make_llm()
    bm = llm.engine.core.block_manager
    llm.generate(OTHERS[:6], SamplingParams(temperature=0, max_tokens=10))
    for i in range(3):
        llm.engine.add_request(f"x{i}", llm.tokenizer.encode(OTHERS[i]), SamplingParams(max_tokens=50))
    llm.engine.step()
    assert bm.num_used_blocks > 0
    for i in range(3):
        llm.engine.abort(f"x{i}")
    assert bm.num_free_blocks == bm.num_blocks and not llm.engine.has_unfinished_requests()
    bm.check_integrity()
