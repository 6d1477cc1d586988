"""Adapters over GGUF bases (blocks kept as stored: the adapter adds its product, the base stays
quantized), GGUF LoRA files as llama.cpp's converter writes them, and a quantized int8 base."""

from __future__ import annotations

import pytest

pytest.importorskip("peft")

from tests.helpers.gguf_writer import write_gguf
from tests.helpers.hf_reference import gguf_parsed_once, hf_greedy, load_hf_reference
from tests.helpers.peft_adapters import make_peft_adapter, write_gguf_adapter
from tokenloom import LLM, SamplingParams
from tokenloom.lora.layers import LoRALinear
from tokenloom.quant.gguf.modules import GGMLLinear
from tokenloom.quant.int8.modules import QuantizedLinear

PROMPTS = [[5, 17, 42, 99, 7, 3, 250, 64, 12, 77, 31], [200, 1, 2, 3]]
# logprob of the reference's first token over a quantized base (the adapter moves them by several)
QUANTIZED_TOLERANCE = 0.15
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=0)


@pytest.fixture(scope="module", params=["llama_gqa", "qwen2"])
def made(request, tiny_model_dir, tmp_path_factory):
    base = tiny_model_dir(request.param)
    root = tmp_path_factory.mktemp(f"gguf_{request.param}")
    adapter = make_peft_adapter(base, root / "peft", r=8, seed=5)
    return base, adapter, root


def test_a_gguf_adapter_gives_the_peft_folders_tokens(made):
    base, adapter, root = made
    for outtype in ("F32", "F16"):
        gguf_adapter = write_gguf_adapter(base, adapter, root / f"adapter-{outtype}.gguf", outtype)
        llm = LLM(str(base), kv_cache_memory=16 << 20, lora={"peft": str(adapter), "gguf": str(gguf_adapter)})
        peft_out = llm.generate(PROMPTS, GREEDY, lora="peft")
        gguf_out = llm.generate(PROMPTS, GREEDY, lora="gguf")
        for p, g in zip(peft_out, gguf_out):
            assert g.outputs[0].token_ids == p.outputs[0].token_ids
            tolerance = 1e-5 if outtype == "F32" else 2e-2  # F16 factors
            got = [lp[t] for lp, t in zip(g.outputs[0].logprobs, g.outputs[0].token_ids)]
            want = [lp[t] for lp, t in zip(p.outputs[0].logprobs, p.outputs[0].token_ids)]
            assert got == pytest.approx(want, abs=tolerance)


def test_an_adapter_over_a_q8_0_base_matches_peft_on_the_dequantized_weights(made):
    from peft import PeftModel

    base, adapter, root = made
    q8 = write_gguf(base, root / "base-Q8_0.gguf", quantize="Q8_0")
    with gguf_parsed_once():  # transformers reads the same file, its blocks dequantized
        reference = PeftModel.from_pretrained(load_hf_reference(q8.parent, gguf_file=q8.name), adapter).eval()
    refs = [hf_greedy(reference, prompt, GREEDY.max_tokens) for prompt in PROMPTS]
    dense = LLM(str(q8), dtype="float32", kv_cache_memory=16 << 20, lora={"a": str(adapter)})
    for ref, result in zip(refs, dense.generate(PROMPTS, GREEDY, lora="a")):  # the same weights: exact
        out = result.outputs[0]
        assert out.token_ids == ref.tokens
        assert [lp[t] for lp, t in zip(out.logprobs, out.token_ids)] == pytest.approx(ref.logprobs, abs=1e-4)
    blocks = LLM(str(q8), kv_cache_memory=16 << 20, lora={"a": str(adapter)})
    wrapped = [m for m in blocks.engine.model.modules() if isinstance(m, LoRALinear)]
    assert wrapped and all(isinstance(m.base, GGMLLinear | QuantizedLinear) for m in wrapped)  # blocks kept
    top5 = SamplingParams(temperature=0, max_tokens=1, logprobs=5)
    for ref, prompt in zip(refs, PROMPTS):  # the kernels round activations to int8 too: close, not equal
        first = blocks.generate([prompt], top5, lora="a")[0].outputs[0].logprobs[0]
        assert first[ref.tokens[0]] == pytest.approx(ref.logprobs[0], abs=QUANTIZED_TOLERANCE)


def test_an_adapter_over_an_int8_base(made):
    base, adapter, _ = made
    float_base = LLM(str(base), kv_cache_memory=16 << 20, lora={"a": str(adapter)})
    int8_base = LLM(str(base), kv_cache_memory=16 << 20, quantization="int8", lora={"a": str(adapter)})
    for prompt in PROMPTS:
        want = float_base.generate([prompt], GREEDY, lora="a")[0].outputs[0]
        got = int8_base.generate([prompt], GREEDY, lora="a")[0].outputs[0]
        plain = int8_base.generate([prompt], GREEDY)[0].outputs[0]
        want_first = want.logprobs[0][want.token_ids[0]]
        assert got.logprobs[0][want.token_ids[0]] == pytest.approx(want_first, abs=QUANTIZED_TOLERANCE)
        assert got.token_ids[0] == want.token_ids[0] != plain.token_ids[0]


def test_a_gguf_model_file_is_not_an_adapter(made):
    base, _, root = made
    model_file = write_gguf(base, root / "not-an-adapter.gguf")
    with pytest.raises(ValueError, match="is not a GGUF LoRA adapter"):
        LLM(str(base), kv_cache_memory=16 << 20, lora={"x": str(model_file)})
