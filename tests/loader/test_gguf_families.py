"""Every GGUF architecture tokenloom reads, from files written the way llama.cpp writes them
(tests/gguf_writer.py) out of the tiny random HF models: float32 files give greedy tokens
identical to transformers on the HF folder and logprobs within 1e-4; quantized files keep
their blocks (experts included) and stay close to the same file dequantized."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tests.helpers.gguf_writer import write_gguf
from tests.helpers.hf_reference import hf_greedy, load_hf_reference
from tokenloom import LLM, SamplingParams
from tokenloom.quant.gguf.modules import GGMLLinear
from tokenloom.quant.int8.modules import QuantizedLinear

FAMILIES = [
    "llama_gqa",
    "llama3_rope_scaling",
    "qwen2",
    "qwen3",
    "smollm3",
    "olmo2",
    "olmo3",
    "glm4",
    "cohere2",
    "phi3_partial_rotary",
    "phi3_longrope",
    "gemma2",
    "mixtral",
    "qwen2_moe",
    "qwen3_moe",
    "olmoe",
    "gpt_oss",
    "deepseek_v3",
    "deepseek_v2",
    "granite",
    "granitemoe_shared",
    "granite_hybrid",
    "qwen3_next",
    "stablelm",
    "stablelm_parallel",
]
# llama.cpp's GGUF does not store Gemma 2's query_pre_attn_scalar (head_dim is assumed): the
# folder written out says so too
GGUF_EXPRESSIBLE = {"gemma2": {"query_pre_attn_scalar": 32}}
# nor gpt-oss's SwiGLU limit (llama.cpp fixes it at 7.0, as the released models have it)
GGUF_EXPRESSIBLE["gpt_oss"] = {"swiglu_limit": 7.0}
PROMPTS = [[5, 17, 42, 99, 7, 3, 250, 64, 12, 77, 31], [200, 1, 2, 3], [8] * 20]
NEW_TOKENS = 32


@pytest.mark.parametrize("arch", FAMILIES + ["mixtral-one-tensor-per-expert"])
def test_float_gguf_matches_transformers_on_the_hf_folder(arch, tiny_model_dir, tmp_path):
    arch, _, one_each = arch.partition("-")
    folder = tiny_model_dir(arch)
    if arch in GGUF_EXPRESSIBLE:
        folder = shutil.copytree(folder, tmp_path / "hf")
        cfg = json.loads((folder / "config.json").read_text()) | GGUF_EXPRESSIBLE[arch]
        (folder / "config.json").write_text(json.dumps(cfg))
    path = write_gguf(folder, tmp_path / f"{arch}.gguf", stack_experts=not one_each)
    llm = LLM(str(path), kv_cache_memory=16 << 20, max_num_batched_tokens=7)  # chunked prefill on
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)
    ours = llm.generate(PROMPTS, params)
    hf_model = load_hf_reference(folder)
    for prompt, result in zip(PROMPTS, ours):
        ref = hf_greedy(hf_model, prompt, NEW_TOKENS)
        out = result.outputs[0]
        assert out.token_ids == ref.tokens
        assert [lp[t] for lp, t in zip(out.logprobs, out.token_ids)] == pytest.approx(ref.logprobs, abs=1e-4)


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe"])
def test_quantized_experts_keep_their_blocks(arch, tiny_model_dir, tmp_path):
    path = write_gguf(tiny_model_dir(arch), tmp_path / f"{arch}-q8.gguf", quantize="Q8_0")
    kept = LLM(str(path), kv_cache_memory=16 << 20)
    block = kept.engine.core.runner.model.model.layers[0].mlp
    assert all(
        isinstance(e.gate_up_proj, QuantizedLinear | GGMLLinear)
        and isinstance(e.down_proj, QuantizedLinear | GGMLLinear)
        for e in block.experts
    )
    assert not isinstance(block.gate, QuantizedLinear | GGMLLinear)  # the router stays float
    dequantized = LLM(str(path), kv_cache_memory=16 << 20, dtype="float32").engine.core.runner.model.model.layers[0].mlp
    x = torch.randn(5, block.gate.in_features, generator=torch.Generator().manual_seed(0))
    for expert, reference in zip(block.experts, dequantized.experts):  # each expert's own stored blocks
        got, want = expert.forward(x), reference.forward(x)
        assert (got - want).norm() < 0.03 * want.norm()
    torch.testing.assert_close(block.forward(x), dequantized.forward(x), rtol=0.05, atol=0.05 * x.abs().max().item())


def test_gpt_oss_mxfp4_experts_run_as_stored(tiny_model_dir, tmp_path):
    """gpt-oss as its GGUFs ship: the experts in MXFP4 (17 bytes per 32 weights), kept as stored and
    run by the GGML kernels, attention float; each expert within the kernels' int8 activation
    rounding of the same blocks dequantized, and the model's greedy opening the same."""
    path = write_gguf(tiny_model_dir("gpt_oss"), tmp_path / "mxfp4.gguf", quantize="MXFP4", experts_only=True)
    kept = LLM(str(path), kv_cache_memory=16 << 20)
    layer = kept.engine.core.runner.model.model.layers[0]
    kinds = {seg.kind for e in layer.mlp.experts for p in (e.gate_up_proj, e.down_proj) for _, seg in p.segments}
    assert kinds == {39}  # every expert matrix holds MXFP4 blocks
    assert not isinstance(layer.self_attn.qkv_proj, QuantizedLinear | GGMLLinear)
    dequantized = LLM(str(path), kv_cache_memory=16 << 20, dtype="float32")
    block = dequantized.engine.core.runner.model.model.layers[0].mlp
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(0))
    for expert, reference in zip(layer.mlp.experts, block.experts):
        got, want = expert.forward(x), reference.forward(x)
        assert (got - want).norm() < 0.03 * want.norm()
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)  # (a near-tie flips the 10th)
    assert [o.outputs[0].token_ids for o in kept.generate(PROMPTS, params)] == [
        o.outputs[0].token_ids for o in dequantized.generate(PROMPTS, params)
    ]


def test_a_quantized_gguf_prepares_an_hf_folder_of_its_weights(tiny_model_dir, tmp_path):
    """`tokenloom pull` prepares the default model this way on a fresh machine: a GGUF with Q8_0
    blocks becomes float32 safetensors under the HF names, each within Q8_0's rounding (half a
    step of its block's scale, plus the scale's float16 rounding times 127) of the HF weights
    the file was written from (Q and K rows in HF's order again)."""
    from safetensors.torch import load_file

    from tokenloom.loader.load import save_hf_folder

    folder = tiny_model_dir("llama_gqa")
    path = write_gguf(folder, tmp_path / "q8.gguf", quantize="Q8_0")
    save_hf_folder(path, tmp_path / "hf", progress=False)
    saved = load_file(str(tmp_path / "hf" / "model.safetensors"))
    original = load_file(str(folder / "model.safetensors"))
    assert set(saved) == set(original)
    for name, want in original.items():
        got = saved[name]
        assert got.dtype == torch.float32 and got.shape == want.shape, name
        blocks = want.float().reshape(-1, 32) if want.shape[-1] % 32 == 0 else want.float().reshape(1, -1)
        step = blocks.abs().amax(dim=1, keepdim=True) / 127
        err = (got.reshape(blocks.shape) - blocks).abs()
        assert (err <= step * (0.5 + 127 * 2**-11) + 1e-6).all(), name  # + the scale's float16 rounding
