"""Several decode steps in one engine step (SchedulerConfig.decode_steps): each step's tokens are
fed back without the host reading them, and the host sees them all at once. Nothing a user can
observe may change: the same tokens and text as one step at a time, greedy or seeded, with stops
(EOS, stop ids, max_tokens, stop strings, the context end) landing inside a run, prefix caching,
preemption, and requests that cannot decode ahead (logprobs, penalties) mixed in."""

from __future__ import annotations

import pytest

from tokenloom import LLM, SamplingParams

PROMPTS = [[5, 17, 42, 99, 7, 3], [200, 1, 2, 3], [8] * 20, list(range(30, 67)), [11, 12]]


@pytest.fixture(scope="module")
def folder(tiny_model_dir):
    return str(tiny_model_dir("llama_gqa"))


def run(folder, params, decode_steps, prompts=PROMPTS, **kwargs):
    kwargs.setdefault("kv_cache_memory", 16 << 20)
    llm = LLM(folder, decode_steps=decode_steps, **kwargs)
    outs = llm.generate(prompts, params)
    return llm, [(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason) for o in outs]


def test_the_scheduler_hands_out_several_steps_only_when_all_can(folder):
    llm = LLM(folder, decode_steps=4, kv_cache_memory=16 << 20)
    engine = llm.engine
    for i, p in enumerate(PROMPTS[:2]):
        engine.add_request(str(i), p, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    engine.step()  # the prompts: one step
    sched = engine.core.scheduler.schedule()
    assert [s.decode_steps for s in sched.scheduled] == [4, 4]
    out = engine.core.runner.execute(sched)
    assert [len(t) for t in out.sampled_token_ids] == [4, 4]
    engine.core.scheduler.update_from_output(sched, out)
    for s in sched.scheduled:  # 4 tokens appended, KV for all but the newest
        req = s.request
        assert len(req.output_token_ids) == 5 and req.num_computed_tokens == req.num_tokens - 1
        blocks = engine.core.block_manager
        assert len(blocks.block_ids(req.request_id)) == blocks.blocks_needed(req.num_tokens)
    engine.add_request("logprobs", PROMPTS[2], SamplingParams(temperature=0, max_tokens=10, logprobs=1))
    engine.step()  # admits it: one step for everyone
    engine.step()
    assert all(s.decode_steps == 1 for s in engine.core.scheduler.schedule().scheduled)  # it cannot decode ahead


@pytest.mark.parametrize("decode_steps", [3, 8])
def test_greedy_tokens_equal_one_step_at_a_time(folder, decode_steps):
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (1, 5, 17, 24, 9)]
    many_llm, many = run(folder, params, decode_steps)
    one_llm, one = run(folder, params, 1)
    assert many == one
    assert many_llm.engine.core.scheduler.num_steps < one_llm.engine.core.scheduler.num_steps / 2  # decoded ahead


def test_seeded_sampling_equals_one_step_at_a_time(folder):
    params = [
        SamplingParams(temperature=0.9, top_k=20, top_p=0.9, min_p=0.02, seed=s, max_tokens=19, ignore_eos=True)
        for s in range(len(PROMPTS))
    ]
    assert run(folder, params, 6)[1] == run(folder, params, 1)[1]


def test_stops_inside_a_run_end_where_they_would(folder):
    """A stop id, EOS, a stop string and the context's end inside a run of 8: the same tokens,
    text and finish reasons, and the cache room past each stop given back."""
    _, free = run(folder, [SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)] * len(PROMPTS), 1)
    stop_ids = [tokens[k] for (tokens, _, _), k in zip(free, (3, 5, 9, 2, 12))]
    params = [SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[t]) for t in stop_ids]
    _, many = run(folder, params, 8)
    assert many == run(folder, params, 1)[1]
    assert all(reason == "stop" for _, _, reason in many)
    text_stop = free[1][1][len(free[1][1]) // 2 :][:3]
    params = [SamplingParams(temperature=0, max_tokens=30, stop=[text_stop], ignore_eos=True)]
    assert run(folder, params, 8, PROMPTS[1:2])[1] == run(folder, params, 1, PROMPTS[1:2])[1]
    short = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)]
    assert (
        run(folder, short, 8, PROMPTS[3:4], max_model_len=50)[1]
        == run(folder, short, 1, PROMPTS[3:4], max_model_len=50)[1]
    )


def test_preemption_prefix_hits_and_mixed_settings_equal_one_step_at_a_time(folder):
    """A cache too small for everyone (preemptions), repeated prompts (prefix hits), and requests
    with logprobs or penalties among the others (those steps decode one token)."""
    prompts = PROMPTS + PROMPTS[:3]
    params = [SamplingParams(temperature=0, max_tokens=28, ignore_eos=True) for _ in prompts]
    params[2] = SamplingParams(temperature=0, max_tokens=28, ignore_eos=True, repetition_penalty=1.3)
    params[6] = SamplingParams(temperature=0, max_tokens=28, ignore_eos=True, logprobs=2)
    per_token = LLM(folder, kv_cache_memory=16 << 20).engine.core.kv_bytes_per_token
    small = dict(kv_cache_memory=per_token * 4 * 41, block_size=4)  # 40 blocks: 160 tokens
    llm, many = run(folder, params, 5, prompts, **small)
    assert llm.engine.core.scheduler.num_preemptions > 0
    assert many == run(folder, params, 1, prompts, **small)[1]
