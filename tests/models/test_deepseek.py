"""DeepSeek-V2/V3 beyond parity with transformers (tests/models/test_parity_hf.py): the cache holds
one latent a token, a prompt answered from the prefix cache or after preemption is the plain
reply, a V3 checkpoint's multi-token-prediction layer is skipped, llama.cpp's older GGUFs (kv_b
unsplit) give the newer ones' bits, and what latent attention does not have is an error."""

from __future__ import annotations

import json
import logging
import shutil

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tests.helpers.gguf_writer import write_gguf
from tests.helpers.invariance import check_prefix_hits_and_preemption
from tokenloom import LLM, SamplingParams
from tokenloom.kv_cache.paged import kv_bytes_per_token

PROMPTS = [[5, 17, 42, 99, 7, 3, 250, 64, 12, 77, 31], [200, 1, 2, 3], [8] * 20]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=0)


def test_the_cache_holds_one_latent_a_token_and_reads_values_from_it(tiny_model_dir):
    llm = LLM(str(tiny_model_dir("deepseek_v3")), kv_cache_memory=16 << 20)
    config, kv = llm.engine.model_config, llm.engine.core.runner.kv_cache
    # 3 layers x (16 rope + 32 latent) float32: not 2 x heads x (32 + 24) per layer
    assert kv_bytes_per_token(config, torch.float32) == 3 * (16 + 32) * 4
    assert kv.keys[0].shape[2:] == (1, 48)
    assert kv.values[0].shape[2:] == (1, 32)
    assert kv.values[0].data_ptr() == kv.keys[0].data_ptr() + 16 * 4  # the latent: the keys' tail
    before = kv.keys[1].clone()
    llm.generate(PROMPTS[:1], GREEDY)
    written = (kv.keys[1] != before).any(dim=(2, 3))  # (blocks, slots) written
    assert int(written.sum()) == len(PROMPTS[0]) + GREEDY.max_tokens - 1  # one latent per cached token


@pytest.mark.parametrize("name", ["deepseek_v3", "deepseek_v2"])
def test_prefix_hits_and_preemption_do_not_change_a_reply(name, tiny_model_dir):
    block_bytes = 16 * 3 * 48 * 4  # positions x layers x latent x float32
    check_prefix_hits_and_preemption(str(tiny_model_dir(name)), block_bytes)


def test_a_multi_token_prediction_layer_is_skipped_and_said(tiny_model_dir, tmp_path, caplog):
    from safetensors.torch import load_file, save_file

    source = tiny_model_dir("deepseek_v3")
    folder = shutil.copytree(source, tmp_path / "mtp")
    state = load_file(str(source / "model.safetensors"))
    mtp = {k.replace(".layers.2.", ".layers.3."): v.clone() for k, v in state.items() if ".layers.2." in k}
    mtp["model.layers.3.eh_proj.weight"] = torch.zeros(64, 128)  # V3's MTP-only tensors
    save_file(state | mtp, str(folder / "model.safetensors"))
    cfg = json.loads((folder / "config.json").read_text()) | {"num_nextn_predict_layers": 1}
    (folder / "config.json").write_text(json.dumps(cfg))
    with caplog.at_level(logging.INFO, logger="tokenloom.models.deepseek"):
        with_mtp = LLM(str(folder), kv_cache_memory=16 << 20).generate(PROMPTS, GREEDY)
    assert "skipping layer 3: DeepSeek's multi-token-prediction layer" in caplog.text
    plain = LLM(str(source), kv_cache_memory=16 << 20).generate(PROMPTS, GREEDY)
    assert [r.outputs[0].token_ids for r in with_mtp] == [r.outputs[0].token_ids for r in plain]


def test_an_older_gguf_with_kv_b_unsplit_gives_the_newer_ones_bits(tiny_model_dir, tmp_path):
    folder = tiny_model_dir("deepseek_v2")
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=3)
    split = LLM(str(write_gguf(folder, tmp_path / "split.gguf")), kv_cache_memory=16 << 20)
    older = LLM(str(write_gguf(folder, tmp_path / "older.gguf", split_kv_b=False)), kv_cache_memory=16 << 20)
    assert split.engine.model_config.mla == older.engine.model_config.mla
    for a, b in zip(split.generate(PROMPTS, params), older.generate(PROMPTS, params)):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].logprobs == b.outputs[0].logprobs


def test_a_v3_gguf_reads_back_as_v3_with_its_routing(tiny_model_dir, tmp_path):
    """The file does not say V2 or V3: sigmoid gating does (expert_gating_func), and the routing,
    latent sizes and YaRN's mscale come back as the HF config has them."""
    hf = LLM(str(tiny_model_dir("deepseek_v3")), kv_cache_memory=16 << 20).engine.model_config
    gguf = LLM(str(write_gguf(tiny_model_dir("deepseek_v3"), tmp_path / "v3.gguf")), kv_cache_memory=16 << 20)
    config = gguf.engine.model_config
    assert config.architecture == "DeepseekV3ForCausalLM"
    assert (config.mla, config.moe, config.num_kv_heads, config.head_dim) == (hf.mla, hf.moe, 1, 48)
    assert config.rope.mscale_all_dim == pytest.approx(0.707) and config.rope.factor == 4.0


def test_what_latent_attention_lacks_is_an_error_naming_it(tiny_model_dir):
    from tokenloom.distributed.pipeline import PipelineStage
    from tokenloom.distributed.shard import TensorParallelError, TensorShard
    from tokenloom.loader.load import load_checkpoint
    from tokenloom.models.registry import model_class

    folder = str(tiny_model_dir("deepseek_v2"))
    with pytest.raises(ValueError, match="int8 KV cache is not implemented for latent attention"):
        LLM(folder, kv_cache_memory=16 << 20, kv_cache_dtype="int8")
    config = load_checkpoint(tiny_model_dir("deepseek_v2")).config
    with pytest.raises(TensorParallelError, match="not DeepseekV2ForCausalLM: its latent attention"):
        TensorShard(0, 2).check(config, model_class(config))
    with pytest.raises(TensorParallelError, match="pipeline parallelism .* not DeepseekV2ForCausalLM"):
        PipelineStage(0, 2, config.num_layers).check(config, model_class(config))
