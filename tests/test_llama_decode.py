"""The module-free decode step (models/llama_decode.py) against the module tree it replaces."""

from __future__ import annotations

import pytest

from tokenloom import native
from tokenloom.llm import LLM
from tokenloom.models import llama_decode
from tokenloom.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(not native.cpu_has_avx2(), reason="the decode path needs the AVX2 kernels")


def generate(folder, quantization, batch):
    llm = LLM(folder, quantization=quantization, kv_cache_memory=8 << 20)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=2)
    prompts = [[3, 17, 9, 40, 2][:n] + [5] * n for n in range(1, batch + 1)]
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.parametrize("arch", ["llama_gqa", "mistral_sliding", "llama_linear_rope_bias", "llama_mqa_tied"])
@pytest.mark.parametrize("quantization", [None, "int4"])
def test_decoding_without_the_module_tree_gives_the_same_bits(tiny_model_dir, monkeypatch, arch, quantization):
    folder = str(tiny_model_dir(arch))
    calls = []
    real_run = llama_decode.run
    monkeypatch.setattr(llama_decode, "run", lambda *a: calls.append(1) or real_run(*a))
    fast = generate(folder, quantization, batch=3)
    assert len(calls) >= 9                               # every decode step after the prefill took it
    monkeypatch.setattr(llama_decode, "applies", lambda *a: False)
    assert fast == generate(folder, quantization, batch=3)    # tokens and logprobs, exactly
