"""Real GGUF files as people download them, blocks kept: every tensor kept, the same greedy
text as the file dequantized to float32, memory near the file's size."""

from __future__ import annotations

import pytest
import torch

from tokenloom import LLM, SamplingParams
from tokenloom.eval.agreement import agreement, whole_windows
from tokenloom.eval.scoring import default_eval_text
from tokenloom.loader import hub
from tokenloom.quant.gguf.modules import GGMLEmbedding, GGMLLinear
from tokenloom.quant.int8.modules import QuantizedEmbedding, QuantizedLinear

QWEN = "qwen2.5-coder-0.5b"
needs_qwen = pytest.mark.skipif(not hub.is_pulled(QWEN), reason=f"`tokenloom pull {QWEN}` has not run")


def quantized_layers(model) -> tuple[int, list[str]]:
    """(quantized layer count, names of float nn.Linear layers)."""
    quantized = sum(isinstance(m, (QuantizedLinear, GGMLLinear)) for m in model.modules())
    floats = [n for n, m in model.named_modules() if type(m) is torch.nn.Linear]
    return quantized, floats


@pytest.fixture(scope="module")
def qwen_kept():
    """Qwen2.5-Coder Q4_K_M with its blocks kept, shared by the tests that read it."""
    return LLM(str(hub.gguf_path(QWEN)), kv_cache_memory=32 << 20)


@needs_qwen
def test_qwen_q4_k_m_keeps_every_tensor(qwen_kept):
    model = qwen_kept.engine.core.runner.model
    quantized, floats = quantized_layers(model)
    assert floats == []
    assert quantized == 24 * 4 + 1  # qkv, o, gate_up, down per layer + lm_head
    assert isinstance(model.model.embed_tokens, GGMLEmbedding)
    kept = {t for m in model.modules() if isinstance(m, GGMLLinear) for t in m.types}
    assert {t.split()[0] for t in kept} >= {"Q5_0", "Q6_K", "Q4_K", "Q8_0"}


@needs_qwen
def test_qwen_greedy_text_matches_float32_dequantized(qwen_kept):
    prompt = "def fibonacci(n):"
    params = SamplingParams(max_tokens=24, temperature=0)
    kept = qwen_kept.generate([prompt], params)[0]
    full = LLM(str(hub.gguf_path(QWEN)), dtype="float32", kv_cache_memory=32 << 20).generate([prompt], params)[0]
    # int8 activations against float32 ones: the first tokens agree, the text stays code
    same = next(
        (i for i, (a, b) in enumerate(zip(kept.outputs[0].token_ids, full.outputs[0].token_ids)) if a != b),
        len(full.outputs[0].token_ids),
    )
    assert same >= 8, (kept.outputs[0].text, full.outputs[0].text)
    assert "return" in kept.outputs[0].text or "if" in kept.outputs[0].text


def test_default_gguf_kept_as_blocks_agrees_with_float32(default_gguf_path):
    """SmolLM2 Q4_1 + Q8_0: teacher-forced next tokens of the blocks-kept model against the
    float32 dequantized one (same weights; only the int8 activations differ)."""
    path = str(default_gguf_path)
    a, b = (LLM(path, dtype=dtype, kv_cache_memory=32 << 20) for dtype in ("auto", "float32"))
    kept = a.engine.core.runner.model
    quantized, floats = quantized_layers(kept)
    assert floats == [] and quantized == 30 * 4 + 1
    assert isinstance(kept.model.embed_tokens, (QuantizedEmbedding, GGMLEmbedding))
    ids = a.tokenizer.encode(default_eval_text())[:600]
    result = agreement(a.engine, b.engine, ids, window=300)
    assert result.positions == 598
    assert agreement(a.engine, b.engine, ids, window=300, skip=150).positions == 598 - 300
    # measured 95% / 0.007 (second halves); llama.cpp Q4_1 against its float32: 94.8% / 0.006 (docs/BENCHMARKS.md)
    assert result.same_top1 > 0.92
    assert result.kl_mean < 0.02
    same = agreement(b.engine, b.engine, ids[:100], window=100)
    assert same.same_top1 == 1.0 and abs(same.kl_mean) < 1e-6


GEMMA = "gemma3-270m"
needs_gemma = pytest.mark.skipif(not hub.is_pulled(GEMMA), reason=f"`tokenloom pull {GEMMA}` has not run")


@needs_gemma
def test_gemma3_gguf_greedy_matches_transformers_on_the_same_file():
    """Gemma-3-270M Q4_K_M dequantized to float32 by both: the same greedy tokens, logprobs
    within 1e-4; blocks kept: every tensor kept and the same opening."""
    transformers = pytest.importorskip("transformers")
    from tests.helpers.hf_reference import gguf_parsed_once, hf_greedy, load_hf_reference

    path = hub.gguf_path(GEMMA)
    llm = LLM(str(path), dtype="float32", kv_cache_memory=32 << 20)
    prompts = ["Once upon a time, there was a little", "def add(a, b):"]  # prose and code
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=0)
    ours = llm.generate(prompts, params)
    with gguf_parsed_once():
        hf = load_hf_reference(path.parent, gguf_file=path.name)
        hf_tokenizer = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    for prompt, out in zip(prompts, ours):
        ref = hf_greedy(hf, llm.tokenizer.encode(prompt), 16)
        got = out.outputs[0]
        assert got.token_ids == ref.tokens, (prompt, got.text)
        assert [lp[t] for lp, t in zip(got.logprobs, got.token_ids)] == pytest.approx(ref.logprobs, abs=1e-4)
    texts = ["  leading spaces and\ttabs\n\nnewlines", "naïve café 東京 🙂", "<start_of_turn>user\nHi<end_of_turn>"]
    for text in texts:
        assert llm.tokenizer.encode(text) == hf_tokenizer(text).input_ids, text
    del hf, llm
    kept = LLM(str(path), kv_cache_memory=32 << 20)
    quantized, floats = quantized_layers(kept.engine.core.runner.model)
    assert floats == [] and quantized == 18 * 4 + 1
    first = kept.generate(prompts[:1], SamplingParams(max_tokens=8, temperature=0))[0].outputs[0].token_ids
    assert first == ours[0].outputs[0].token_ids[:8]


def test_whole_windows_keeps_the_chunks_llama_perplexity_scores():
    ids = list(range(1100))
    assert whole_windows(ids, 512) == ids[:1024]  # two chunks; the 76 left over are dropped
    assert whole_windows(ids, 550) == ids  # exactly two windows
    assert whole_windows(ids[:300], 512) == ids[:300]  # shorter than one window: all of it
