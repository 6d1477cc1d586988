"""The invariance suite's two scheduling cases, for one model folder: a prompt whose first blocks
come from the prefix cache, and requests preempted for lack of blocks, give the tokens (and
logprobs) of the plain run."""

from __future__ import annotations

import pytest

from tokenloom import LLM, SamplingParams


def chosen_logprobs(output) -> list[float]:
    return [lp[t] for lp, t in zip(output.logprobs, output.token_ids)]


def check_prefix_hits_and_preemption(folder: str, block_bytes: int) -> None:
    """Asserts both cases on `folder`; `block_bytes`: the KV bytes of one 16-position block (ten of
    them are too few for the four prompts at once, so some are preempted)."""
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=0)
    shared = [7, 19, 23, 5, 88, 140, 3, 61] * 5  # 40 tokens: two whole blocks of 16
    prompts = [shared + [200, 9], shared + [31, 4, 77], [5, 17, 42, 99] * 5, [8] * 21]
    plain = LLM(folder, kv_cache_memory=16 << 20, enable_prefix_caching=False).generate(prompts, params)

    cached = LLM(folder, kv_cache_memory=16 << 20)
    cached.generate(prompts[:1], params)
    hit = cached.generate(prompts[1:2], params)[0]
    assert hit.outputs[0].metrics.num_cached_prompt_tokens == 32
    assert hit.outputs[0].token_ids == plain[1].outputs[0].token_ids

    cramped_llm = LLM(folder, kv_cache_memory=10 * block_bytes, enable_prefix_caching=False)
    cramped = cramped_llm.generate(prompts, params)  # each needs 4 blocks at the end: 16 > 10
    assert cramped_llm.engine.stats().num_preemptions > 0
    for a, b in zip(cramped, plain):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert chosen_logprobs(a.outputs[0]) == pytest.approx(chosen_logprobs(b.outputs[0]), abs=1e-5)
