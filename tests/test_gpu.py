"""The CUDA path: parity with HF transformers on the GPU in float32/bfloat16/float16, CUDA-graph
decode equal to eager decode at every bucket, quantized weights (dequantize-per-call fallback)
and the int8 KV cache on the GPU.

Skipped without a CUDA device (conftest marks `gpu`)."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import TINY_CONFIGS
from tests.helpers.hf_reference import hf_greedy, load_hf_reference
from tokenloom import LLM, SamplingParams

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.gpu

PROMPTS = [[5, 17, 42, 99, 7, 3, 250, 64, 12, 77, 31], [200, 1, 2, 3], [8] * 20]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def hf_on_cuda(folder, dtype: torch.dtype):
    return load_hf_reference(folder, dtype).to("cuda")


@pytest.mark.parametrize("arch", sorted(TINY_CONFIGS))
def test_cuda_float32_greedy_matches_hf_on_cuda(arch, tiny_model_dir):
    folder = tiny_model_dir(arch)
    llm = LLM(str(folder), device="cuda", dtype="float32", kv_cache_memory=16 << 20, max_num_seqs=4)
    assert llm.engine.core.runner.kv_cache.keys[0].device.type == "cuda"
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=0)
    hf = hf_on_cuda(folder, torch.float32)
    for prompt, result in zip(PROMPTS, llm.generate(PROMPTS, params)):
        ref = hf_greedy(hf, prompt, 24)
        out = result.outputs[0]
        n = next((i for i, m in enumerate(ref.margins) if m < 1e-3), len(ref.margins))  # up to a near-tie
        assert out.token_ids[:n] == ref.tokens[:n]
        got = [lp[t] for lp, t in zip(out.logprobs[:n], out.token_ids[:n])]
        assert got == pytest.approx(ref.logprobs[:n], abs=1e-3)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("arch", ["llama_gqa", "qwen2", "gpt2"])
def test_cuda_reduced_precision_tracks_hf_in_the_same_precision(arch, dtype, tiny_model_dir):
    folder = tiny_model_dir(arch)
    llm = LLM(str(folder), dtype=dtype, device="cuda", kv_cache_memory=16 << 20, max_num_seqs=4)
    assert llm.engine.core.runner.kv_cache.keys[0].dtype == DTYPES[dtype]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=0)
    hf = hf_on_cuda(folder, DTYPES[dtype])
    for prompt, result in zip(PROMPTS, llm.generate(PROMPTS, params)):
        ref = hf_greedy(hf, prompt, 16)
        out = result.outputs[0]
        assert out.token_ids[0] == ref.tokens[0] or ref.margins[0] < 0.1
        assert out.logprobs[0][out.token_ids[0]] == pytest.approx(ref.logprobs[0], abs=0.1)


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_cuda_quantized_weights_compute_what_the_cpu_fallback_computes(quantization, tiny_model_dir, monkeypatch):
    """On the GPU a quantized layer dequantizes its weight per call and runs a float matmul:
    the same math as the CPU without its kernels (float rounding apart)."""
    from tokenloom.quant.int8 import kernels

    folder = str(tiny_model_dir("llama_gqa"))
    ids = list(range(3, 40))
    gpu = LLM(
        folder, device="cuda", dtype="float32", quantization=quantization, kv_cache_memory=8 << 20, max_num_seqs=4
    )
    got = torch.cat([lg for _, lg in gpu.engine.prefill_logits(ids)]).cpu()
    monkeypatch.setattr(kernels, "available", lambda: False)
    cpu = LLM(folder, device="cpu", quantization=quantization, kv_cache_memory=8 << 20)
    want = torch.cat([lg for _, lg in cpu.engine.prefill_logits(ids)])
    assert ((got - want).norm() / want.norm()).item() < 1e-4
    ref = LLM(folder, device="cuda", dtype="float32", kv_cache_memory=8 << 20, max_num_seqs=4)
    float_logits = torch.cat([lg for _, lg in ref.engine.prefill_logits(ids)]).cpu()
    assert not torch.allclose(got, float_logits)  # really quantized


def test_cuda_int8_kv_cache_tracks_float(tiny_model_dir):
    folder = str(tiny_model_dir("llama_gqa"))
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=0)
    a = LLM(folder, device="cuda", kv_cache_memory=8 << 20, max_num_seqs=4).generate(PROMPTS, params)
    b = LLM(folder, device="cuda", kv_cache_dtype="int8", kv_cache_memory=8 << 20).generate(PROMPTS, params)
    for x, y in zip(a, b):
        lx = x.outputs[0].logprobs[0][x.outputs[0].token_ids[0]]
        ly = y.outputs[0].logprobs[0][x.outputs[0].token_ids[0]]
        assert ly == pytest.approx(lx, abs=0.05)


def test_cuda_structured_output_scoring_and_beam_search(tiny_model_dir):
    """The newer decoding features on the CUDA path: token masks applied to GPU logits, prompt
    logprobs equal to the CPU's, beam search equal to the CPU's beams."""
    import re

    from tokenloom.structured import StructuredOutput

    folder = str(tiny_model_dir("llama_gqa"))
    gpu = LLM(folder, device="cuda", dtype="float32", kv_cache_memory=8 << 20, max_num_seqs=4)
    cpu = LLM(folder, device="cpu", kv_cache_memory=8 << 20)
    constrained = SamplingParams(
        temperature=1.0, seed=0, max_tokens=12, structured_output=StructuredOutput.regex(r"[ab]{3,6}")
    )
    for out in gpu.generate([PROMPTS[0]] * 4, [constrained] * 4):  # (decode the ids: this id prompt ends
        text = gpu.tokenizer.decode(out.outputs[0].token_ids)  # mid-character, which .text completes)
        assert re.fullmatch(r"[ab]{3,6}", text), text
    scored = SamplingParams(max_tokens=0, prompt_logprobs=2)
    g = gpu.generate([PROMPTS[0]], scored)[0].prompt_logprobs
    c = cpu.generate([PROMPTS[0]], scored)[0].prompt_logprobs
    assert [e[t] for e, t in zip(g[1:], PROMPTS[0][1:])] == pytest.approx(
        [e[t] for e, t in zip(c[1:], PROMPTS[0][1:])], abs=1e-3
    )
    gb = gpu.beam_search(PROMPTS[0], beam_width=3, max_tokens=8)
    cb = cpu.beam_search(PROMPTS[0], beam_width=3, max_tokens=8)
    assert [h.token_ids for h in gb] == [h.token_ids for h in cb]
    assert [h.score for h in gb] == pytest.approx([h.score for h in cb], abs=1e-3)


def test_cuda_defaults_to_bfloat16_with_decode_graphs(tiny_model_dir):
    llm = LLM(str(tiny_model_dir("llama_gqa")), device="cuda", kv_cache_memory=8 << 20, max_num_seqs=6)
    assert llm.engine.core.runner.kv_cache.keys[0].dtype == torch.bfloat16
    graphs = llm.engine.core.runner.graphs
    assert graphs is not None and sorted(graphs.graphs) == [1, 2, 4, 6]
    moe = LLM(str(tiny_model_dir("mixtral")), device="cuda", kv_cache_memory=8 << 20, max_num_seqs=4)
    assert moe.engine.core.runner.graphs is None  # its router reads values on the host
    out = moe.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4


@pytest.mark.parametrize("dtype,tol", [("float32", 1e-5), ("bfloat16", 1e-3)])
@pytest.mark.parametrize("arch", ["llama_gqa", "qwen3", "gemma2", "mistral_sliding"])
def test_cuda_graph_decode_equals_eager_at_every_bucket(arch, dtype, tol, tiny_model_dir):
    """Batches of 1, 2, 3, 5 and 8 sequences (buckets 1, 2, 4, 8, 8: padded rows included) decode
    the same tokens with and without graphs, logprobs within `tol`, up to a near-tie in eager's."""
    folder = str(tiny_model_dir(arch))
    graphs = LLM(
        folder, device="cuda", dtype=dtype, kv_cache_memory=16 << 20, max_num_seqs=8, enable_prefix_caching=False
    )
    eager = LLM(
        folder,
        device="cuda",
        dtype=dtype,
        kv_cache_memory=16 << 20,
        max_num_seqs=8,
        enable_prefix_caching=False,
        enforce_eager=True,
    )
    assert graphs.engine.core.runner.graphs is not None and eager.engine.core.runner.graphs is None
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    prompts = [[(7 * i + j) % 300 + 3 for j in range(3 + 5 * i)] for i in range(8)]
    for n in (1, 2, 3, 5, 8):
        for g, e in zip(graphs.generate(prompts[:n], params), eager.generate(prompts[:n], params)):
            go, eo = g.outputs[0], e.outputs[0]
            margins = [sorted(lp.values())[-1] - sorted(lp.values())[-2] if len(lp) > 1 else 1.0 for lp in eo.logprobs]
            k = next((i for i, m in enumerate(margins) if m < 10 * tol), len(margins))
            assert go.token_ids[: k + 1] == eo.token_ids[: k + 1], n
            got = [lp[t] for lp, t in zip(go.logprobs[: k + 1], go.token_ids[: k + 1])]
            want = [lp[t] for lp, t in zip(eo.logprobs[: k + 1], eo.token_ids[: k + 1])]
            assert got == pytest.approx(want, abs=tol), n


def test_cuda_prefix_hits_and_chunked_prefill_match_a_whole_prefill(tiny_model_dir):
    """The Triton kernels read a prompt's cached prefix in place: a prompt prefilled in chunks, or
    found in the prefix cache, decodes what a whole prefill does (float32)."""
    folder = str(tiny_model_dir("qwen2"))
    prompt = [(5 * j) % 300 + 2 for j in range(70)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)
    whole = (
        LLM(
            folder,
            device="cuda",
            dtype="float32",
            kv_cache_memory=16 << 20,
            max_num_seqs=4,
            enable_prefix_caching=False,
        )
        .generate([prompt], params)[0]
        .outputs[0]
    )
    chunked_llm = LLM(
        folder, device="cuda", dtype="float32", kv_cache_memory=16 << 20, max_num_seqs=4, max_num_batched_tokens=24
    )
    chunked = chunked_llm.generate([prompt], params)[0].outputs[0]
    hit = chunked_llm.generate([prompt], params)[0].outputs[0]  # the prompt's blocks cached now
    for other in (chunked, hit):
        assert other.token_ids == whole.token_ids
        assert [lp[t] for lp, t in zip(other.logprobs, other.token_ids)] == pytest.approx(
            [lp[t] for lp, t in zip(whole.logprobs, whole.token_ids)], abs=1e-5
        )


def test_cuda_decode_steps_with_graphs_equal_single_eager_steps(tiny_model_dir):
    """The GPU default, 8 tokens decoded in a row from graph replays with the sampled tokens fed back
    on the device, against one eager step per token (float32): the same greedy and seeded tokens."""
    folder = str(tiny_model_dir("qwen2"))
    fast = LLM(folder, device="cuda", dtype="float32", kv_cache_memory=16 << 20, max_num_seqs=8)
    slow = LLM(
        folder,
        device="cuda",
        dtype="float32",
        kv_cache_memory=16 << 20,
        max_num_seqs=8,
        enforce_eager=True,
        decode_steps=1,
    )
    assert fast.engine.config.scheduler.decode_steps == 8
    prompts = [[(3 * i + j) % 300 + 1 for j in range(4 + 6 * i)] for i in range(5)]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (3, 20, 9, 31, 16)]
    params[1] = SamplingParams(temperature=0.8, top_k=30, top_p=0.9, seed=5, max_tokens=20, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in fast.generate(prompts, params)]
    want = [o.outputs[0].token_ids for o in slow.generate(prompts, params)]
    assert got == want
    assert fast.engine.core.scheduler.num_steps < slow.engine.core.scheduler.num_steps / 2


@pytest.mark.parametrize("quantize", [None, "Q8_0"])
def test_cuda_loads_a_gguf_file_dequantized_to_bfloat16(quantize, tiny_model_dir, tmp_path):
    """A GGUF file on the GPU: its blocks dequantized to bf16 at load (kept as stored on the CPU only),
    its first greedy token's logprob the float32 CPU run's on the same file, up to bf16 rounding."""
    from tests.helpers.gguf_writer import write_gguf

    path = tmp_path / "tiny.gguf"
    write_gguf(tiny_model_dir("llama_gqa"), path, quantize=quantize)
    gpu = LLM(str(path), device="cuda", kv_cache_memory=8 << 20, max_num_seqs=4)
    assert gpu.engine.core.runner.kv_cache.keys[0].dtype == torch.bfloat16
    assert all(p.dtype == torch.bfloat16 and p.is_cuda for p in gpu.engine.core.runner.model.parameters())
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=0)
    cpu = LLM(str(path), device="cpu", kv_cache_memory=8 << 20).generate(PROMPTS, params)
    for g, c in zip(gpu.generate(PROMPTS, params), cpu):
        best = [max(out.outputs[0].logprobs[0].values()) for out in (g, c)]  # the greedy token's
        assert best[0] == pytest.approx(best[1], abs=0.1)
