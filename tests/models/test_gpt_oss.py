"""gpt-oss as OpenAI ships it: an HF folder whose experts are MXFP4 blocks and scales. Read as
float, it matches transformers on the same folder; kept as stored, its experts are MXFP4 GGML
blocks, bit for bit the model a GGUF file of the same blocks gives."""

from __future__ import annotations

import json
import shutil

import pytest

transformers = pytest.importorskip("transformers")

from tests.helpers.gguf_writer import write_gguf
from tests.helpers.hf_reference import hf_greedy, load_hf_reference
from tests.helpers.invariance import check_prefix_hits_and_preemption
from tests.helpers.mxfp4_folder import write_mxfp4_folder
from tokenloom import LLM, SamplingParams
from tokenloom.quant.gguf.mxfp4 import MXFP4

PROMPTS = [[5, 17, 42, 99, 7, 3, 250, 64, 12, 77, 31], [200, 1, 2, 3], [8] * 20]
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def mxfp4_folder(tiny_model_dir, tmp_path_factory):
    return write_mxfp4_folder(tiny_model_dir("gpt_oss"), tmp_path_factory.mktemp("gpt_oss") / "mxfp4")


def test_an_mxfp4_folder_read_as_float_matches_transformers(mxfp4_folder):
    llm = LLM(str(mxfp4_folder), dtype="float32", kv_cache_memory=16 << 20)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)
    ours = llm.generate(PROMPTS, params)
    hf_model = load_hf_reference(mxfp4_folder)  # transformers dequantizes MXFP4 on the CPU
    for prompt, result in zip(PROMPTS, ours):
        ref = hf_greedy(hf_model, prompt, NEW_TOKENS)
        out = result.outputs[0]
        assert out.token_ids == ref.tokens
        assert [lp[t] for lp, t in zip(out.logprobs, out.token_ids)] == pytest.approx(ref.logprobs, abs=1e-4)


def test_an_mxfp4_folder_keeps_its_blocks_as_a_gguf_of_them_does(tiny_model_dir, tmp_path):
    # the SwiGLU limit GGUF files assume (they do not store it)
    folder = shutil.copytree(tiny_model_dir("gpt_oss"), tmp_path / "float")
    cfg = json.loads((folder / "config.json").read_text()) | {"swiglu_limit": 7.0}
    (folder / "config.json").write_text(json.dumps(cfg))
    kept = LLM(str(write_mxfp4_folder(folder, tmp_path / "mxfp4")), kv_cache_memory=16 << 20)
    experts = kept.engine.core.runner.model.model.layers[1].mlp.experts
    kinds = {seg.kind for e in experts for p in (e.gate_up_proj, e.down_proj) for _, seg in p.segments}
    assert kinds == {MXFP4}
    gguf_path = write_gguf(folder, tmp_path / "m.gguf", quantize="MXFP4", experts_only=True)
    from_gguf = LLM(str(gguf_path), kv_cache_memory=16 << 20)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2)
    for a, b in zip(kept.generate(PROMPTS, params), from_gguf.generate(PROMPTS, params)):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].logprobs == b.outputs[0].logprobs  # the same blocks: the same bits


def test_mxfp4_blocks_without_their_scales_are_an_error(mxfp4_folder, tmp_path):
    from safetensors.torch import load_file, save_file

    from tokenloom.loader.weights import WeightMismatchError

    broken = tmp_path / "broken"
    broken.mkdir()
    for f in mxfp4_folder.iterdir():
        if f.name != "model.safetensors":
            (broken / f.name).write_bytes(f.read_bytes())
    state = load_file(str(mxfp4_folder / "model.safetensors"))
    del state["model.layers.0.mlp.experts.down_proj_scales"]
    save_file(state, str(broken / "model.safetensors"))
    with pytest.raises((ValueError, WeightMismatchError), match="down_proj"):
        LLM(str(broken), kv_cache_memory=16 << 20)


def test_prefix_hits_and_preemption_do_not_change_a_reply(tiny_model_dir):
    """The invariance suite's two scheduling cases on gpt-oss (sinks, a 6-position window): a
    prompt whose first blocks come from the prefix cache, and requests preempted for lack of
    blocks, give the tokens and logprobs of the plain run."""
    block_bytes = 16 * 2 * 2 * 2 * 16 * 4  # positions x layers x (k, v) x kv heads x head_dim x float32
    check_prefix_hits_and_preemption(str(tiny_model_dir("gpt_oss")), block_bytes)


def test_a_gguf_as_released_splits_like_o200k_and_ends_at_call_and_return(tiny_model_dir, tmp_path):
    """Released gpt-oss GGUFs name their pre-tokenizer "gpt-4o" and one end token, <|return|>; a
    reply that calls a tool ends at <|call|> (llama.cpp finds it, and <|endoftext|>, by its text)."""
    from tests.helpers.harmony_chat import harmony_model

    folder = harmony_model(tiny_model_dir("gpt_oss"), tmp_path / "harmony")
    hf = LLM(str(folder), kv_cache_memory=16 << 20)
    end = {t: hf.tokenizer.encode(t, add_special_tokens=False)[0] for t in ("<|return|>", "<|call|>")}
    path = write_gguf(
        folder, tmp_path / "o200k.gguf", pre="gpt-4o", extra={"tokenizer.ggml.eos_token_id": end["<|return|>"]}
    )
    llm = LLM(str(path), kv_cache_memory=16 << 20)
    assert set(end.values()) <= set(llm.engine.model_config.eos_token_ids)
    text = "Hello world, the quick brown fox.<|start|>assistant<|channel|>final<|message|>"
    assert llm.tokenizer.encode(text, add_special_tokens=False) == hf.tokenizer.encode(text, add_special_tokens=False)
