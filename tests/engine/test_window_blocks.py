"""Sliding-window layers that keep only the blocks their window reads (kv_cache/window_pool.py) give
the same tokens and logprobs as keeping every block, batched, in chunks, from prefix hits, after
preemption and across context shifts, while one sequence's window-layer blocks stay bounded."""

from __future__ import annotations

import math

import pytest

from tokenloom import LLM, SamplingParams

BLOCK = 4
WINDOW = 6  # the tiny models' sliding_window (tests/conftest.py)


def _engine(folder, window_blocks: bool, **kwargs) -> LLM:
    kwargs = {"dtype": "float32", "max_model_len": 128, "block_size": BLOCK, "kv_cache_memory": 4 << 20} | kwargs
    return LLM(str(folder), window_blocks=window_blocks, **kwargs)


def _run(llm: LLM, prompts: list[list[int]], max_tokens: int = 24):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=3)
    outs = llm.generate(prompts, params)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]


def _assert_same(got, want):
    for (tokens, logprobs), (want_tokens, want_logprobs) in zip(got, want):
        assert tokens == want_tokens
        for step, want_step in zip(logprobs, want_logprobs):
            assert step.keys() == want_step.keys()
            for token, value in step.items():
                assert math.isclose(float(value), float(want_step[token]), abs_tol=1e-4)


PROMPTS = [list(range(3, 40)), list(range(3, 30)) + [7, 8, 9], list(range(50, 61)), [5] * 23]


@pytest.mark.parametrize("arch", ["gemma3", "gpt_oss", "mistral_sliding", "qwen2_window_layers"])
def test_window_blocks_change_nothing_a_sequence_sees(tiny_model_dir, arch):
    folder = tiny_model_dir(arch)
    apart = _engine(folder, True, max_num_batched_tokens=16)  # prompts in chunks of at most 16 tokens
    assert apart.engine.core.block_manager.window is not None
    whole = _engine(folder, False, max_num_batched_tokens=16)
    assert whole.engine.core.block_manager.window is None
    want = _run(whole, PROMPTS)
    _assert_same(_run(apart, PROMPTS), want)
    _assert_same(_run(apart, PROMPTS), want)  # again: every prompt starts from cached blocks now
    apart.engine.core.block_manager.check_integrity()


def test_preempted_sequences_recompute_to_the_same_tokens(tiny_model_dir):
    folder = tiny_model_dir("gemma3")
    prompts = [list(range(3 + i, 30 + i)) for i in range(6)]
    want = _run(_engine(folder, False), prompts, 40)
    tight = _engine(folder, True, kv_cache_memory=None, kv_cache_contexts=1, max_model_len=96)  # room for ~1
    _assert_same(_run(tight, prompts, 40), want)
    assert tight.engine.core.scheduler.num_preemptions > 0


def test_one_long_sequence_holds_only_its_windows_blocks(tiny_model_dir):
    llm = _engine(tiny_model_dir("gemma3"), True, max_model_len=256)
    engine, blocks = llm.engine, llm.engine.core.block_manager
    pool = blocks.window
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    engine.add_request("a", list(range(3, 20)), params)
    most = 0
    while engine.has_unfinished_requests():
        engine.step()
        most = max(most, pool.num_blocks - pool.num_available)
    assert engine.core.runner.kv_cache.num_window_blocks > 10  # room it did not need
    # a query reads WINDOW positions: at most 3 blocks of 4, and the step's new block
    assert most <= math.ceil(WINDOW / BLOCK) + 2


def test_context_shift_with_window_blocks_matches_keeping_every_block(tiny_model_dir):
    folder = tiny_model_dir("gemma3")
    kwargs = {"max_model_len": 32, "context_shift": True}
    prompts = [list(range(3, 20)), list(range(3, 12))]
    want = _run(_engine(folder, False, **kwargs), prompts, 80)
    apart = _engine(folder, True, **kwargs)
    _assert_same(_run(apart, prompts, 80), want)
    assert apart.engine.core.scheduler.num_context_shifts >= 4
    apart.engine.core.block_manager.check_integrity()


def test_a_prefix_hit_whose_window_blocks_went_to_others_is_cut_short(tiny_model_dir):
    folder = tiny_model_dir("gemma3")
    first, others = PROMPTS[0], [list(range(60 + 40 * i, 97 + 40 * i)) for i in range(4)]
    want = _run(_engine(folder, False), [first])
    small = _engine(folder, True, max_num_seqs=1, max_num_batched_tokens=16)  # a pool of a few windows
    pool = small.engine.core.block_manager.window
    assert pool.num_blocks < 40
    _run(small, [first])
    for prompt in others:  # each takes every backing the first prompt's cached blocks kept
        _run(small, [prompt])
    stats = small.engine.core.block_manager.stats
    hits_before = stats.hit_tokens
    _assert_same(_run(small, [first]), want)
    assert stats.hit_tokens - hits_before < len(first) - 1  # its full layers' blocks alone would hit


def test_borrowed_blocks_serve_embeddings_and_full_logits_alike(tiny_model_dir):
    import torch

    folder = tiny_model_dir("gemma3")
    apart, whole = _engine(folder, True).engine, _engine(folder, False).engine
    tokens = list(range(3, 45))
    torch.testing.assert_close(
        torch.tensor(apart.embed(tokens)), torch.tensor(whole.embed(tokens)), atol=1e-5, rtol=1e-5
    )
    for (start, ours), (_, theirs) in zip(
        apart.prefill_logits(tokens, chunk_size=16), whole.prefill_logits(tokens, chunk_size=16)
    ):
        torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4, msg=f"chunk at {start}")
    apart.core.block_manager.check_integrity()
