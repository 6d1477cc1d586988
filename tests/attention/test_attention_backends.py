"""The attention op's kernel backend (one rope+cache-write pass, decode and prefill kernels) against
its torch backend (separate ops): the same tokens and logprobs, to the bit."""

from __future__ import annotations

import pytest

from tokenloom.attention import backend
from tokenloom.entrypoints.llm import LLM
from tokenloom.kernels import native
from tokenloom.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(not native.cpu_has_avx2(), reason="the decode path needs the AVX2 kernels")


def generate(folder, quantization, batch):
    llm = LLM(folder, quantization=quantization, kv_cache_memory=8 << 20)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=2)
    prompts = [[3, 17, 9, 40, 2][:n] + [5] * n for n in range(1, batch + 1)]
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in llm.generate(prompts, params, use_tqdm=False)]


def count_runs(monkeypatch) -> list[list[int]]:
    """Patches the kernel backend to record the query lengths of every step it takes."""
    steps = []
    real_init = backend.KernelAttention.__init__

    def init(self, shape, meta, *rest):
        steps.append(list(meta.query_lens))
        real_init(self, shape, meta, *rest)

    monkeypatch.setattr(backend.KernelAttention, "__init__", init)
    return steps


@pytest.mark.parametrize(
    "arch",
    [
        "llama_gqa",
        "mistral_sliding",
        "llama_linear_rope_bias",
        "llama_mqa_tied",
        "qwen3",
        "gemma2",
        "phi3_partial_rotary",
        "stablelm",
        "gpt_oss",
    ],
)  # soft-cap; partial rotary; sinks
@pytest.mark.parametrize("quantization", [None, "int4"])
def test_decoding_on_the_kernel_backend_gives_the_same_bits(tiny_model_dir, monkeypatch, arch, quantization):
    folder = str(tiny_model_dir(arch))
    steps = count_runs(monkeypatch)
    fast = generate(folder, quantization, batch=3)
    assert len(steps) >= 9  # every decode step after the prefill took it
    monkeypatch.setattr(backend, "kernels_take", lambda *a: False)
    assert fast == generate(folder, quantization, batch=3)  # tokens and logprobs, exactly


def mixed_steps(folder, quantization, chunk):
    """Three requests, the later ones prefilled (in chunks of `chunk` tokens) while the
    earlier decode: greedy tokens and logprobs of each, in order."""
    llm = LLM(
        folder,
        quantization=quantization,
        kv_cache_memory=8 << 20,
        max_num_batched_tokens=chunk,
        enable_prefix_caching=False,
    )
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    prompts = [[3, 17, 9, 40, 2] * 4, [7, 7, 1] * 9, [11, 4] * 20]
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
        for _ in range(3):
            engine.step()
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = (out.completion.token_ids, out.completion.logprobs)
    return [done[str(i)] for i in range(len(prompts))]


@pytest.mark.skipif(
    not native.cpu_has_avx512(), reason="prompt chunks take the kernel backend only with the AVX-512 prefill kernel"
)
@pytest.mark.parametrize("quantization", [None, "int4"])
@pytest.mark.parametrize("chunk", [7, 64])
@pytest.mark.parametrize("arch", ["llama3_rope_scaling", "gemma2"])  # head_dim 32: the prefill kernel takes it
def test_steps_mixing_decodes_and_prompt_chunks_give_the_same_bits(
    tiny_model_dir, monkeypatch, arch, quantization, chunk
):
    folder = str(tiny_model_dir(arch))
    steps = count_runs(monkeypatch)
    fast = mixed_steps(folder, quantization, chunk)
    assert any(1 in lens and max(lens) > 1 for lens in steps)  # mixed steps took it
    monkeypatch.setattr(backend, "kernels_take", lambda *a: False)
    assert fast == mixed_steps(folder, quantization, chunk)
