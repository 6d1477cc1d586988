"""The hybrids (Granite 4.0-H's Mamba-2 layers, Qwen3-Next's Gated DeltaNet layers) beyond parity
with transformers (tests/models/test_parity_hf.py, tests/loader/test_gguf_families.py): only their
attention layers keep keys and values, each sequence holds one recurrent-state slot, a preempted or
failed sequence recomputes its state from position 0, prefix caching is off (and said), and what the
state rules out is an error."""

from __future__ import annotations

import logging

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tests.helpers.gguf_writer import write_gguf
from tests.helpers.invariance import chosen_logprobs
from tokenloom import LLM, SamplingParams
from tokenloom.kv_cache.paged import kv_bytes_per_token
from tokenloom.quant.gguf.modules import GGMLLinear
from tokenloom.quant.int8.modules import QuantizedLinear

PROMPTS = [[5, 17, 42, 99, 7, 3, 250, 64, 12, 77, 31], [200, 1, 2, 3], [8] * 20]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=0)
# tiny config -> (architecture, what its recurrent layers are called in errors); each has one
# attention layer of 2 kv heads x 16 dims
HYBRIDS = {
    "granite_hybrid": ("GraniteMoeHybridForCausalLM", "Mamba-2"),
    "qwen3_next": ("Qwen3NextForCausalLM", "Gated DeltaNet"),
}


def _replies(results) -> list[list[int]]:
    return [r.outputs[0].token_ids for r in results]


def test_only_attention_layers_keep_kv_and_each_sequence_one_state_slot(tiny_model_dir):
    llm = LLM(str(tiny_model_dir("granite_hybrid")), kv_cache_memory=16 << 20, max_num_seqs=3)
    config, kv = llm.engine.model_config, llm.engine.core.runner.kv_cache
    # one attention layer (of four) x K and V x 2 kv heads x 16 dims x float32
    assert kv_bytes_per_token(config, torch.float32) == 1 * 2 * 2 * 16 * 4
    assert [k.shape[0] > 0 for k in kv.keys] == [False, True, False, False]
    assert kv.states is not None and kv.states.layers == [0, 2, 3]
    # max_num_seqs + 1 slots; conv: x (8 x 16) + B, C (2 groups x 16 each) channels x 3 taps back
    assert kv.states.conv[0].shape == (4, 8 * 16 + 2 * 2 * 16, 3)
    assert kv.states.state[2].shape == (4, 8, 16, 16) and kv.states.state[2].dtype == torch.float32
    blocks = llm.engine.core.block_manager
    llm.generate(PROMPTS, GREEDY)
    assert blocks.state_slot("0") == -1  # released with the request's blocks
    blocks.check_integrity()


def test_qwen3_next_keeps_kv_for_its_attention_layer_and_a_deltanet_state_per_slot(tiny_model_dir):
    llm = LLM(str(tiny_model_dir("qwen3_next")), kv_cache_memory=16 << 20, max_num_seqs=3)
    kv = llm.engine.core.runner.kv_cache
    assert [k.shape[0] > 0 for k in kv.keys] == [False, True, False, False]
    assert kv.states is not None and kv.states.layers == [0, 2, 3]
    # max_num_seqs + 1 slots; conv: q, k (2 key heads x 16) and v (4 value heads x 8) x 3 taps back;
    # the delta rule's state: per value head keys (16) x values (8), float32
    assert kv.states.conv[0].shape == (4, 2 * 2 * 16 + 4 * 8, 3)
    assert kv.states.state[3].shape == (4, 4, 16, 8) and kv.states.state[3].dtype == torch.float32


def test_qwen3_next_skips_its_multi_token_prediction_weights_and_says_so(tiny_model_dir, tmp_path, caplog):
    import shutil

    from safetensors.torch import load_file, save_file

    folder = shutil.copytree(tiny_model_dir("qwen3_next"), tmp_path / "with_mtp")
    weights = load_file(folder / "model.safetensors")
    save_file(
        weights | {"mtp.fc.weight": torch.ones(64, 128), "mtp.norm.weight": torch.ones(64)},
        folder / "model.safetensors",
    )
    with caplog.at_level(logging.INFO, logger="tokenloom"):
        with_mtp = LLM(str(folder), kv_cache_memory=16 << 20).generate(PROMPTS, GREEDY)
    assert "Qwen3-Next's multi-token-prediction layer is not run" in caplog.text
    plain = LLM(str(tiny_model_dir("qwen3_next")), kv_cache_memory=16 << 20).generate(PROMPTS, GREEDY)
    assert _replies(with_mtp) == _replies(plain)


def test_qwen3_next_configs_it_cannot_run_are_refused_naming_why(tiny_model_dir):
    import json

    from tokenloom.models.config import ModelConfig, UnsupportedModelError

    config = json.loads((tiny_model_dir("qwen3_next") / "config.json").read_text())
    with pytest.raises(UnsupportedModelError, match="without full_attention layers"):
        ModelConfig.from_hf(config | {"layer_types": ["linear_attention"] * 4})
    with pytest.raises(UnsupportedModelError, match="activation 'gelu' are not implemented"):
        ModelConfig.from_hf(config | {"hidden_act": "gelu"})
    with pytest.raises(ValueError, match="3 value heads do not share 2 key heads"):
        ModelConfig.from_hf(config | {"linear_num_value_heads": 3})


@pytest.mark.parametrize("hybrid", HYBRIDS)
def test_a_one_token_prompt_batched_with_decoding_sequences_starts_from_zero(hybrid, tiny_model_dir):
    """The slot a finished request leaves holds its state: the next sequence given it must not
    read it, whether it arrives as a one-token prompt (the decode path) or a longer one."""
    llm = LLM(str(tiny_model_dir(hybrid)), kv_cache_memory=16 << 20)
    prompts = [[9], *PROMPTS, [200]]
    alone = [_replies(llm.generate([p], GREEDY))[0] for p in prompts]
    assert _replies(llm.generate(prompts, GREEDY)) == alone
    assert _replies(llm.generate(prompts[::-1], GREEDY)) == alone[::-1]
    assert llm.engine.core.runner.failed_batches == 0  # the batches ran as batches


@pytest.mark.parametrize("hybrid", HYBRIDS)
def test_preempted_requests_recompute_their_state(hybrid, tiny_model_dir):
    folder = str(tiny_model_dir(hybrid))
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=0)
    prompts = [[7, 19, 23, 5, 88, 140, 3, 61] * 5 + [200, 9], [5, 17, 42, 99] * 5, [8] * 21, [31, 4, 77] * 9]
    plain = LLM(folder, kv_cache_memory=16 << 20).generate(prompts, params)
    block_bytes = 16 * 2 * 2 * 16 * 4  # positions x (K, V) x kv heads x dims x float32, one attention layer
    cramped_llm = LLM(folder, kv_cache_memory=10 * block_bytes)
    cramped = cramped_llm.generate(prompts, params)
    assert cramped_llm.engine.stats().num_preemptions > 0
    # a recomputed sequence runs its history as a prompt (the delta rule's chunked form) where the
    # uninterrupted one decoded it (its step form): the two round differently, carried over ~80
    # positions in the tiny Qwen3-Next (each is within ~1e-5 of a float64 run)
    tolerance = 3e-5 if hybrid == "qwen3_next" else 1e-5
    for a, b in zip(cramped, plain):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert chosen_logprobs(a.outputs[0]) == pytest.approx(chosen_logprobs(b.outputs[0]), abs=tolerance)


@pytest.mark.parametrize("hybrid", HYBRIDS)
def test_prefix_caching_is_off_and_said(hybrid, tiny_model_dir, caplog):
    with caplog.at_level(logging.INFO, logger="tokenloom"):
        llm = LLM(str(tiny_model_dir(hybrid)), kv_cache_memory=16 << 20)
    assert f"prefix caching is off for {HYBRIDS[hybrid][0]}" in caplog.text
    prompt = [7, 19, 23, 5, 88, 140, 3, 61] * 5
    first = llm.generate([prompt], GREEDY)[0].outputs[0]
    again = llm.generate([prompt], GREEDY)[0].outputs[0]
    assert again.metrics.num_cached_prompt_tokens == 0
    assert again.token_ids == first.token_ids


@pytest.mark.parametrize("hybrid", HYBRIDS)
def test_a_step_that_fails_part_way_recomputes_each_sequence_from_position_zero(hybrid, tiny_model_dir):
    """The batched forward raises in the last layer, after the Mamba layers below it advanced every
    sequence's state: each sequence is run again alone from position 0, and the replies are those
    of a run that never failed."""
    folder = str(tiny_model_dir(hybrid))
    expected = _replies(LLM(folder, kv_cache_memory=16 << 20).generate(PROMPTS, GREEDY))
    llm = LLM(folder, kv_cache_memory=16 << 20)
    llm.engine.core.runner.recompute_tokens = 7  # the recomputation in pieces, the state carried
    last = llm.engine.core.runner.model.model.layers[-1]
    forward, failures = last.mlp.forward, []

    def fail_once_in_a_decode_batch(x):
        if x.shape[0] == len(PROMPTS) and len(failures) < 2:  # a decode step of all three, twice
            failures.append(x.shape[0])
            raise RuntimeError("injected")
        return forward(x)

    last.mlp.forward = fail_once_in_a_decode_batch
    assert _replies(llm.generate(PROMPTS, GREEDY)) == expected
    assert failures == [3, 3] and llm.engine.core.runner.failed_batches == 2


@pytest.mark.parametrize("hybrid", HYBRIDS)
def test_a_multi_step_decode_that_fails_part_way_recomputes_its_sequences(hybrid, tiny_model_dir):
    """With several tokens decoded in a row on the device (decode_steps), a failure at the second
    step leaves every state one token ahead: the step that follows recomputes each sequence from
    position 0, and the replies are those of a run that never failed."""
    folder = str(tiny_model_dir(hybrid))
    plain = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    expected = _replies(LLM(folder, kv_cache_memory=16 << 20).generate(PROMPTS, plain))
    llm = LLM(folder, kv_cache_memory=16 << 20, decode_steps=4)
    last = llm.engine.core.runner.model.model.layers[-1]
    forward, calls = last.mlp.forward, []

    def fail_at_the_second_step_once(x):
        if x.shape[0] == len(PROMPTS):
            calls.append(x.shape[0])
            if len(calls) == 2:
                raise RuntimeError("injected")
        return forward(x)

    last.mlp.forward = fail_at_the_second_step_once
    assert _replies(llm.generate(PROMPTS, plain)) == expected
    assert len(calls) > 2


def test_what_the_recurrent_state_rules_out_is_an_error_naming_it(tiny_model_dir):
    import json

    from tokenloom.models.config import ModelConfig, UnsupportedModelError

    hybrid, granite = str(tiny_model_dir("granite_hybrid")), str(tiny_model_dir("granite"))
    with pytest.raises(ValueError, match="has recurrent layers: their state cannot be rolled back"):
        LLM(granite, kv_cache_memory=16 << 20, speculative=f"draft={hybrid},k=3")
    config = json.loads((tiny_model_dir("granite_hybrid") / "config.json").read_text())
    with pytest.raises(UnsupportedModelError, match="without attention layers"):
        ModelConfig.from_hf(config | {"layer_types": ["mamba"] * 4})


@pytest.mark.parametrize("hybrid", HYBRIDS)
def test_full_logits_in_chunks_carry_the_state_across_chunks(hybrid, tiny_model_dir):
    llm = LLM(str(tiny_model_dir(hybrid)), kv_cache_memory=16 << 20)
    tokens = [5, 17, 42, 99, 7, 3, 250, 64, 12, 77, 31] * 3
    whole = torch.cat([lg for _, lg in llm.engine.prefill_logits(tokens, chunk_size=64)])
    chunked = torch.cat([lg for _, lg in llm.engine.prefill_logits(tokens, chunk_size=5)])
    torch.testing.assert_close(chunked, whole, rtol=0, atol=1e-4)


@pytest.mark.parametrize("hybrid", HYBRIDS)
def test_speculative_decoding_and_splitting_are_refused_naming_why(hybrid, tiny_model_dir):
    from tokenloom.distributed.pipeline import PipelineStage
    from tokenloom.distributed.shard import TensorParallelError, TensorShard
    from tokenloom.loader.load import load_checkpoint
    from tokenloom.models.registry import model_class

    folder = tiny_model_dir(hybrid)
    arch, layers = HYBRIDS[hybrid]
    with pytest.raises(ValueError, match=f"speculative decoding is not implemented for {arch}.*recurrent"):
        LLM(str(folder), kv_cache_memory=16 << 20, speculative="ngram,k=3")
    config = load_checkpoint(folder).config
    with pytest.raises(TensorParallelError, match=f"not {arch}: its {layers} layers"):
        TensorShard(0, 2).check(config, model_class(config))
    with pytest.raises(TensorParallelError, match=f"pipeline parallelism .* not {arch}"):
        PipelineStage(0, 2, config.num_layers).check(config, model_class(config))


@pytest.mark.parametrize("hybrid", HYBRIDS)
def test_a_quantized_gguf_keeps_the_recurrent_projections_as_blocks(hybrid, tiny_model_dir, tmp_path):
    """Q8_0 blocks in the recurrent layers' projections (and the attention's) are kept and run
    within the int8 kernels' rounding of the same blocks dequantized."""
    folder = tiny_model_dir(hybrid)
    path = write_gguf(folder, tmp_path / "q8.gguf", quantize="Q8_0")
    q8 = LLM(str(path), kv_cache_memory=16 << 20)
    dequantized = LLM(str(path), kv_cache_memory=16 << 20, dtype="float32")
    for kept, reference in zip(_projections(q8, hybrid), _projections(dequantized, hybrid)):
        assert isinstance(kept, QuantizedLinear | GGMLLinear)
        x = torch.randn(5, kept.in_features, generator=torch.Generator().manual_seed(0))
        got, want = kept.forward(x), reference.forward(x)
        assert (got - want).norm() < 0.03 * want.norm()
    # the whole model: the tiny Qwen3-Next's logprobs move by up to ~0.9 under Q8_0's rounding of its
    # weights alone (the dequantized file run in float32), so only Granite's are held to 0.05
    if hybrid == "granite_hybrid":
        f32 = LLM(str(write_gguf(folder, tmp_path / "f32.gguf")), kv_cache_memory=16 << 20)
        tokens = PROMPTS[0] * 2
        got = torch.cat([lg for _, lg in q8.engine.prefill_logits(tokens)]).log_softmax(-1)
        want = torch.cat([lg for _, lg in f32.engine.prefill_logits(tokens)]).log_softmax(-1)
        assert (got - want).abs().max() < 0.05


def _projections(llm, hybrid: str) -> list:
    """The first recurrent layer's in_proj and out_proj, and the attention layer's qkv_proj."""
    layers = llm.engine.core.runner.model.model.layers
    mixer = layers[0].mamba if hybrid == "granite_hybrid" else layers[0].linear_attn
    return [mixer.in_proj, mixer.out_proj, layers[1].self_attn.qkv_proj]


def test_a_dense_hybrid_gguf_reads_its_shared_mlp_as_the_mlp(tiny_model_dir, tmp_path):
    """Without experts the converter writes the shared MLP as ffn_gate/up/down and switches rope
    off for a model with Mamba layers (as llama.cpp then runs it): the file reads back with the
    HF folder's weights and sizes, its attention unturned."""
    folder = tiny_model_dir("granite_hybrid_dense")
    hf = LLM(str(folder), kv_cache_memory=16 << 20)
    gguf = LLM(str(write_gguf(folder, tmp_path / "dense.gguf")), kv_cache_memory=16 << 20)
    a, b = hf.engine.model_config, gguf.engine.model_config
    assert (b.moe, b.recurrent, b.intermediate_size) == (None, a.recurrent, 96)
    assert a.rope_layers is None and b.rope_layers == (False,) * 3
    ours, theirs = hf.engine.core.runner.model.model.layers, gguf.engine.core.runner.model.model.layers
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(theirs[1].mlp.forward(x), ours[1].mlp.forward(x))
    for name in ("A_log", "D", "dt_bias", "norm.weight", "conv1d.weight", "conv1d.bias"):
        torch.testing.assert_close(theirs[2].mamba.get_parameter(name), ours[2].mamba.get_parameter(name))


def test_qwen3_next_renormalizes_its_chosen_experts_unless_told_otherwise(tiny_model_dir):
    """transformers' Qwen3NextConfig defaults norm_topk_prob to true (Qwen3-MoE's to false)."""
    import json

    from tokenloom.models.config import ModelConfig

    config = json.loads((tiny_model_dir("qwen3_next") / "config.json").read_text())
    config.pop("norm_topk_prob")
    assert ModelConfig.from_hf(config).moe.normalize_top_k
    assert not ModelConfig.from_hf(config | {"norm_topk_prob": False}).moe.normalize_top_k
