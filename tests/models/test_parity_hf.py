"""tokenloom vs HF transformers on the same random weights, in float32.

Greedy tokens must be identical for 32+ new tokens and the chosen tokens'
logprobs within 1e-4 of HF's, for every supported architecture and flag.
"""

from __future__ import annotations

import pytest

transformers = pytest.importorskip("transformers")

from tests.conftest import TINY_CONFIGS
from tests.helpers.hf_reference import hf_greedy, load_hf_reference
from tokenloom import LLM, SamplingParams
from tokenloom.attention import cpu_decode

NEW_TOKENS = 40
PROMPTS = [[5, 17, 42, 99, 7, 3, 250, 64, 12, 77, 31], [200, 1, 2, 3], [8] * 20]


@pytest.mark.parametrize("arch", sorted(TINY_CONFIGS))
def test_greedy_tokens_and_logprobs_match_hf(arch, tiny_model_dir):
    folder = tiny_model_dir(arch)
    llm = LLM(str(folder), kv_cache_memory=16 << 20)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)
    ours = llm.generate(PROMPTS, params)
    assert llm.engine.core.runner.failed_batches == 0  # no step fell back to its requests run alone
    hf_model = load_hf_reference(folder)
    for prompt, result in zip(PROMPTS, ours):
        ref = hf_greedy(hf_model, prompt, NEW_TOKENS)
        assert min(ref.margins) > 1e-4, "reference has a near-tie (fp32 noise could flip it); pick another seed"
        out = result.outputs[0]
        assert out.token_ids == ref.tokens
        got = [lp[t] for lp, t in zip(out.logprobs, out.token_ids)]
        assert got == pytest.approx(ref.logprobs, abs=1e-4)


@pytest.mark.parametrize(
    "arch",
    [
        "llama_gqa",
        "mistral_sliding",
        "qwen2_window_layers",
        "gemma3",
        "olmo2",
        "gpt2",
        "mixtral",
        "qwen2_moe",
        "gemma2",
        "phi3_longrope",
        "stablelm",
        "gpt_oss",
        "deepseek_v3",
        "granite",
        "granite_hybrid",
        "qwen3_next",
    ],
)
def test_batched_equals_one_at_a_time(arch, tiny_model_dir):
    llm = LLM(str(tiny_model_dir(arch)), kv_cache_memory=16 << 20)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=0)
    batched = llm.generate(PROMPTS, params)
    assert llm.engine.core.runner.failed_batches == 0
    for prompt, b in zip(PROMPTS, batched):
        single = llm.generate([prompt], params)[0].outputs[0]
        assert b.outputs[0].token_ids == single.token_ids
        for lb, ls in zip(b.outputs[0].logprobs, single.logprobs):
            assert lb.keys() == ls.keys()
            assert list(lb.values()) == pytest.approx(list(ls.values()), abs=1e-5)


@pytest.mark.parametrize(
    "arch",
    [
        "llama_gqa",
        "mistral_sliding",
        "qwen2_window_layers",
        "gemma3",
        "olmo2",
        "qwen3_moe",
        "gemma2",
        "phi3_partial_rotary",
        "olmoe",
        "stablelm_parallel",
        "gpt_oss",
        "deepseek_v2",
        "granitemoe_shared",
        "granite_hybrid",
        "granite_hybrid_dense",
        "qwen3_next",
    ],
)
def test_chunked_prefill_equals_whole_prefill(arch, tiny_model_dir):
    folder = str(tiny_model_dir(arch))
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=0)
    whole = LLM(folder, kv_cache_memory=16 << 20).generate(PROMPTS, params)
    chunked_llm = LLM(folder, kv_cache_memory=16 << 20, max_num_batched_tokens=5)
    chunked = chunked_llm.generate(PROMPTS, params)
    assert chunked_llm.engine.core.runner.failed_batches == 0
    for w, c in zip(whole, chunked):
        assert w.outputs[0].token_ids == c.outputs[0].token_ids
        lw = [d[t] for d, t in zip(w.outputs[0].logprobs, w.outputs[0].token_ids)]
        lc = [d[t] for d, t in zip(c.outputs[0].logprobs, c.outputs[0].token_ids)]
        assert lc == pytest.approx(lw, abs=1e-5)


def test_batched_decode_ignores_garbage_past_each_sequence(tiny_model_dir):
    """Cache slots past a sequence's end must not leak in, even when they hold NaN."""
    llm = LLM(str(tiny_model_dir("llama_gqa")), kv_cache_memory=16 << 20)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    expected = [llm.generate([p], params)[0].outputs[0].token_ids for p in PROMPTS]
    kv = llm.engine.core.runner.kv_cache
    for k, v in zip(kv.keys, kv.values):  # every block a request can be given (not the null block)
        k[: kv.num_blocks].fill_(float("nan"))
        v[: kv.num_blocks].fill_(float("nan"))
    llm.engine.core.block_manager.reset_prefix_cache()  # the cached prefixes' contents were just destroyed
    assert [r.outputs[0].token_ids for r in llm.generate(PROMPTS, params)] == expected


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_fresh_blocks_are_cleared_only_where_a_reader_looks_past_the_context(tiny_model_dir, kv_cache_dtype):
    """The padded decode batch (no kernels) masks slots past each sequence's end
    and needs them zero; the float32 CPU kernels read only the context, so clearing is skipped
    there (the NaN test above shows nothing leaks either way)."""
    llm = LLM(str(tiny_model_dir("llama_gqa")), kv_cache_memory=16 << 20, kv_cache_dtype=kv_cache_dtype)
    runner = llm.engine.core.runner
    kernel_reads_all = cpu_decode.build()  # float32 and int8 caches: every decoding row on the kernel
    assert runner.zero_fresh_blocks is (not kernel_reads_all)
    cleared = []
    clear = runner.kv_cache.zero_blocks
    runner.kv_cache.zero_blocks = lambda ids, window_ids=None: (cleared.append(ids.tolist()), clear(ids, window_ids))
    llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    assert bool(cleared) is (not kernel_reads_all)


def test_gpt2_runs_at_a_context_shorter_than_its_position_table(tiny_model_dir):
    """The learned position table has the checkpoint's rows whatever --max-model-len is."""
    folder = tiny_model_dir("gpt2")
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    (short,) = LLM(str(folder), max_model_len=64, kv_cache_memory=16 << 20).generate([PROMPTS[0]], params)
    (full,) = LLM(str(folder), kv_cache_memory=16 << 20).generate([PROMPTS[0]], params)
    assert short.outputs[0].token_ids == full.outputs[0].token_ids
