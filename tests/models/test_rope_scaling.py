"""Context-dependent rope scalings (longrope, dynamic): fixed by the context the engine runs
at, and equal to transformers' own where transformers would make the same choice."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tests.helpers.hf_reference import hf_greedy, load_hf_reference
from tokenloom import LLM, SamplingParams
from tokenloom.layers.rope import rope_inv_freq
from tokenloom.models.config import ModelConfig

PROMPTS = [[5, 17, 42, 99, 7, 3, 250, 64, 12, 77, 31], [200, 1, 2, 3], [8] * 20]


def test_longrope_short_factors_within_the_original_context(tiny_model_dir, tmp_path):
    """Run at no more than the original length, every position uses the short factors, as
    transformers does for sequences that short."""
    folder = tmp_path / "phi3"
    shutil.copytree(tiny_model_dir("phi3_longrope"), folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["original_max_position_embeddings"] = cfg["rope_parameters"]["original_max_position_embeddings"] = 64
    (folder / "config.json").write_text(json.dumps(cfg))
    llm = LLM(str(folder), kv_cache_memory=16 << 20, max_model_len=64)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=0)
    hf_model = load_hf_reference(folder)
    for prompt, result in zip(PROMPTS, llm.generate(PROMPTS, params)):
        ref = hf_greedy(hf_model, prompt, 40)
        out = result.outputs[0]
        assert out.token_ids == ref.tokens
        assert [lp[t] for lp, t in zip(out.logprobs, out.token_ids)] == pytest.approx(ref.logprobs, abs=1e-4)


def test_dynamic_rope_stretches_the_base_for_a_longer_context(tiny_model_dir):
    folder = tiny_model_dir("llama_dynamic")
    hf_config = json.loads((folder / "config.json").read_text())
    config = ModelConfig.from_hf(hf_config)
    assert config.context_limit() == 4 * 256
    init = transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS["dynamic"]
    reference = transformers.AutoConfig.from_pretrained(folder)
    for context in (256, 700, 1024):
        expected, _ = init(reference, "cpu", seq_len=context)
        torch.testing.assert_close(rope_inv_freq(config.rope, config.rotary_dim, context), expected, rtol=1e-6, atol=0)
    stretched = LLM(str(folder), kv_cache_memory=16 << 20, max_model_len=1024)
    assert not torch.equal(stretched.engine.model.inv_freq, rope_inv_freq(config.rope, config.rotary_dim, 256))
    with pytest.raises(ValueError, match="max_model_len 2048 exceeds the model's context length 1024"):
        LLM(str(folder), kv_cache_memory=16 << 20, max_model_len=2048)
