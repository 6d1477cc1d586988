"""Quantized weights and the int8 KV cache on the real default model: quality, invariance, files."""

from __future__ import annotations

import json

import pytest
import torch

from tests.helpers.hf_reference import load_hf_reference
from tokenloom import LLM, SamplingParams
from tokenloom.eval.scoring import default_eval_text, perplexity

KV = 64 << 20


def argmax_tokens(llm: LLM, ids: list[int]) -> torch.Tensor:
    """The model's greedy choice at every position of `ids` (teacher forcing)."""
    return torch.cat([logits.argmax(-1) for _, logits in llm.engine.prefill_logits(ids)])


@pytest.fixture(scope="module")
def float_continuation(smol_llm):
    """Prompt + the float model's own greedy continuation: what 'greedy generation' produces."""
    prompts = ["Once upon a time", "The capital of France is", "def fibonacci(n):"]
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    outs = smol_llm.generate(prompts, params)
    return [o.prompt_token_ids + o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def int8_llm(default_model_dir):
    return LLM(str(default_model_dir), quantization="int8", kv_cache_memory=KV)


@pytest.mark.parametrize(
    "variant,min_agreement", [("int8", 0.9), ("int4", 0.7), ("gguf", 0.8), ("kv-int8", 0.95), ("kv-int4", 0.8)]
)
def test_greedy_tokens_mostly_match_float(
    default_model_dir, default_gguf_path, smol_llm, int8_llm, float_continuation, variant, min_agreement
):
    """Teacher-forced: at each position of the float model's greedy text, the same argmax.
    (The default model's first chat token is a near-tie, so free-running texts can fork early.)"""
    llm = {
        "int8": lambda: int8_llm,
        "int4": lambda: LLM(str(default_model_dir), quantization="int4", kv_cache_memory=KV),
        "gguf": lambda: LLM(str(default_gguf_path), quantization="gguf", kv_cache_memory=KV),
        "kv-int8": lambda: LLM(str(default_model_dir), kv_cache_dtype="int8", kv_cache_memory=KV),
        "kv-int4": lambda: LLM(str(default_model_dir), kv_cache_dtype="int4", kv_cache_memory=KV),
    }[variant]()
    same = total = 0
    for ids in float_continuation:
        want, got = argmax_tokens(smol_llm, ids), argmax_tokens(llm, ids)
        same += int((want == got).sum())
        total += len(ids)
    assert same / total >= min_agreement


@pytest.mark.parametrize("asked", ["the file, quantization=gguf", "no model: the default"])
def test_gguf_blocks_keep_the_files_footprint(default_gguf_path, asked):
    from tokenloom.eval.bench import model_bytes
    from tokenloom.quant import QuantizedEmbedding, QuantizedLinear

    if asked == "no model: the default":
        llm = LLM(kv_cache_memory=KV)
    else:
        llm = LLM(str(default_gguf_path), quantization="gguf", kv_cache_memory=KV)
    model = llm.engine.core.runner.model
    qkv, head = model.model.layers[0].self_attn.qkv_proj, model.lm_head
    assert isinstance(qkv, QuantizedLinear) and qkv.fmt.name == "int4-g32"  # the file's Q4_1
    assert isinstance(head, QuantizedLinear) and head.fmt.name == "int8-g32"  # the file's Q8_0 embedding
    assert isinstance(model.model.embed_tokens, QuantizedEmbedding)  # stored once, tied
    assert model_bytes(model) < 125e6  # the GGUF is 98 MB; float32 would be 538 MB


def test_quantized_prefill_is_batch_invariant_bit_for_bit(default_model_dir):
    """The kernels compute each row on its own, so a prompt's hidden states are the same
    bits alone or packed with another prompt."""
    from tokenloom.worker.batch import SeqChunk

    llm = LLM(str(default_model_dir), quantization="int4", kv_cache_dtype="int8", kv_cache_memory=KV)
    runner, blocks = llm.engine.core.runner, llm.engine.core.block_manager
    a, b = llm.tokenizer.encode("Once upon a time"), llm.tokenizer.encode("List three colors: red")
    for seq in "abc":
        blocks.allocate(seq, 32)
    with torch.inference_mode():
        alone, _ = runner.forward([SeqChunk(a, 0, blocks.block_ids("a"))])
        packed, _ = runner.forward([SeqChunk(b, 0, blocks.block_ids("b")), SeqChunk(a, 0, blocks.block_ids("c"))])
    assert torch.equal(alone, packed[len(b) :])


def test_quantized_generation_is_batch_invariant_bit_for_bit(default_model_dir):
    """With the compiled kernels every op computes a row (or a sequence's attention) on its
    own, so a request's tokens and logprobs are the same bits batched with three others or
    alone (prefix caching off, so each run computes its prompt itself). The torch fallback
    (padded SDPA, dequantize + matmul) gives no such guarantee."""
    from tokenloom.attention import cpu_decode
    from tokenloom.quant.int8 import kernels

    if not (kernels.available() and cpu_decode.build()):
        pytest.skip("the compiled CPU kernels are not available here (torch fallback)")
    llm = LLM(str(default_model_dir), quantization="int8", kv_cache_memory=KV, enable_prefix_caching=False)
    prompts = ["Once upon a time", "List three colors:", "The quick brown fox jumps over", "In 1776,"]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2)
    batched = [o.outputs[0] for o in llm.generate(prompts, params)]
    alone = [llm.generate([p], params)[0].outputs[0] for p in prompts]
    for b, a in zip(batched, alone):
        assert b.token_ids == a.token_ids
        assert b.logprobs == a.logprobs  # exact floats, not approximately


def test_int8_kv_cache_halves_bf16_memory(default_model_dir):
    from tokenloom.kv_cache.paged import kv_bytes_per_token
    from tokenloom.kv_cache.quantized import Int8Cache

    llm = LLM(str(default_model_dir), kv_cache_dtype="int8", kv_cache_memory=KV)
    cfg, kv = llm.engine.model_config, llm.engine.core.runner.kv_cache
    assert isinstance(kv.keys[0], Int8Cache) and kv.keys[0].data.dtype == torch.int8
    per_token = kv_bytes_per_token(cfg, torch.float32, "int8")
    assert per_token == 2 * cfg.num_layers * cfg.num_kv_heads * (cfg.head_dim + 4)
    assert per_token <= 0.55 * kv_bytes_per_token(cfg, torch.bfloat16)
    stored = sum(c.data.nbytes + c.scales.nbytes for c in kv.keys + kv.values)
    assert stored == per_token * (kv.num_blocks + 1) * kv.block_size


def test_perplexity_equals_transformers_and_int8_stays_within_5_percent(default_model_dir, smol_llm, int8_llm):
    pytest.importorskip("transformers")
    ids = smol_llm.tokenizer.encode(default_eval_text())[:512]
    ours = perplexity(smol_llm.engine, ids, window=256)
    hf = load_hf_reference(default_model_dir)
    nll = []
    with torch.no_grad():
        for start in range(0, len(ids), 256):
            piece = torch.tensor([ids[start : start + 256]])
            nll.append(hf(piece, labels=piece).loss * (piece.shape[1] - 1))
    hf_ppl = torch.exp(torch.stack(nll).sum() / (len(ids) - 2)).item()
    assert ours.tokens_scored == len(ids) - 2
    assert ours.perplexity == pytest.approx(hf_ppl, rel=1e-4)
    quantized = perplexity(int8_llm.engine, ids, window=256)
    assert quantized.perplexity == pytest.approx(ours.perplexity, rel=0.05)
    assert quantized.perplexity != ours.perplexity


def test_saved_quantized_folder_loads_without_requantizing(tiny_model_dir, tmp_path, monkeypatch):
    from tokenloom.loader.save import save_quantized
    from tokenloom.quant.checkpoint import describe
    from tokenloom.quant.int8 import formats

    src = tiny_model_dir("llama_mqa_tied")
    modules = save_quantized(src, tmp_path / "q", "int4-g64", progress=False)
    assert modules.pop("lm_head") == "int8"  # int4 keeps the output head at int8, as llama.cpp does
    assert modules and all(f == "int4-g64" for f in modules.values())
    assert describe(tmp_path / "q")["scheme"] == "int4-g64"
    fresh = LLM(str(src), quantization="int4-g64", kv_cache_memory=8 << 20)

    def forbidden(*a, **k):
        raise AssertionError("a saved folder must not be quantized again")

    monkeypatch.setattr(formats, "quantize_int4", forbidden)
    monkeypatch.setattr("tokenloom.quant.int8.modules.quantize", forbidden)
    loaded = LLM(str(tmp_path / "q"), kv_cache_memory=8 << 20)
    a, b = fresh.engine.core.runner.model.state_dict(), loaded.engine.core.runner.model.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    assert (
        loaded.generate(["The quick"], params)[0].outputs[0].token_ids
        == fresh.generate(["The quick"], params)[0].outputs[0].token_ids
    )
    with pytest.raises(ValueError, match="already quantized as int4-g64"):
        LLM(str(tmp_path / "q"), quantization="int8", kv_cache_memory=8 << 20)
    config = json.loads((tmp_path / "q" / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "tokenloom"


@pytest.mark.parametrize("arch", ["llama_gqa", "llama_linear_rope_bias", "qwen3", "gpt2", "mistral_sliding"])
def test_every_architecture_runs_int8_close_to_float(tiny_model_dir, arch):
    folder = str(tiny_model_dir(arch))
    ids = list(range(3, 40))
    ref = LLM(folder, kv_cache_memory=8 << 20)
    q = LLM(folder, quantization="int8", kv_cache_memory=8 << 20)
    want = torch.cat([lg for _, lg in ref.engine.prefill_logits(ids)])
    got = torch.cat([lg for _, lg in q.engine.prefill_logits(ids)])
    assert 0 < ((got - want).norm() / want.norm()).item() < 0.05


def test_bad_quantization_settings_are_clear_errors(default_model_dir, tiny_model_dir):
    with pytest.raises(ValueError, match="quantization must be one of"):
        LLM(str(default_model_dir), quantization="int3")
    with pytest.raises(ValueError, match="int4 group size must be one of|quantization must be one of"):
        LLM(str(default_model_dir), quantization="int4-g48")
    with pytest.raises(ValueError, match="not a GGUF file"):
        LLM(str(tiny_model_dir("llama_gqa")), quantization="gguf")
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        LLM(str(default_model_dir), kv_cache_dtype="fp8")
