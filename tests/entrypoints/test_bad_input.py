"""Bad input gets a clear error that says what was wrong."""

from __future__ import annotations

import json
import shutil

import pytest
from safetensors.torch import load_file, save_file

from tokenloom import LLM, SamplingParams
from tokenloom.entrypoints.cli.commands import main as cli_main
from tokenloom.loader import CheckpointError
from tokenloom.loader.weights import WeightMismatchError
from tokenloom.models.config import UnsupportedModelError


def _copy(src, tmp_path):
    dst = tmp_path / "model"
    shutil.copytree(src, dst)
    return dst


def test_unknown_path():
    with pytest.raises(FileNotFoundError, match="does not exist"):
        LLM("/no/such/model")


def test_unsupported_architecture(tiny_model_dir, tmp_path):
    folder = _copy(tiny_model_dir("llama_gqa"), tmp_path)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["architectures"] = ["MambaForCausalLM"]
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match="MambaForCausalLM.*not supported"):
        LLM(str(folder))


def test_unsupported_architecture_is_named_before_the_weights_are_looked_for(tmp_path):
    """A config.json alone (weights not downloaded yet): what the model is, not 'no safetensors'."""
    (tmp_path / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["FalconForCausalLM"],
                "vocab_size": 10,
                "hidden_size": 8,
                "num_hidden_layers": 1,
                "num_attention_heads": 2,
                "intermediate_size": 16,
            }
        )
    )
    with pytest.raises(UnsupportedModelError, match="FalconForCausalLM.*not supported"):
        LLM(str(tmp_path))


def test_unsupported_rope_type(tiny_model_dir, tmp_path):
    folder = _copy(tiny_model_dir("llama_gqa"), tmp_path)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "ntk-by-parts", "factor": 4.0, "rope_theta": 10000.0}
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match="rope type 'ntk-by-parts'"):
        LLM(str(folder))


@pytest.mark.parametrize("field, value", [("attn_logit_softcapping", 50.0), ("final_logit_softcapping", 30.0)])
def test_config_fields_that_change_the_math_are_refused_by_name(tiny_model_dir, tmp_path, field, value):
    folder = _copy(tiny_model_dir("llama_gqa"), tmp_path)
    cfg = json.loads((folder / "config.json").read_text())
    cfg[field] = value
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match=f"{field}.*not implemented"):
        LLM(str(folder))


def test_qwen2_window_applies_only_from_max_window_layers():
    from tokenloom.models.config import ModelConfig

    hf = dict(
        architectures=["Qwen2ForCausalLM"],
        vocab_size=10,
        hidden_size=8,
        num_hidden_layers=4,
        num_attention_heads=2,
        intermediate_size=16,
        use_sliding_window=True,
        sliding_window=5,
        max_window_layers=3,
    )
    assert ModelConfig.from_hf(hf).layer_windows() == (None, None, None, 5)
    assert ModelConfig.from_hf(hf | {"use_sliding_window": False}).layer_windows() == (None,) * 4
    assert ModelConfig.from_hf(hf | {"architectures": ["MistralForCausalLM"]}).layer_windows() == (5,) * 4
    with pytest.raises(UnsupportedModelError, match="chunked_attention"):
        ModelConfig.from_hf(hf | {"layer_types": ["full_attention"] * 3 + ["chunked_attention"]})


def test_truncated_safetensors(tiny_model_dir, tmp_path):
    folder = _copy(tiny_model_dir("llama_gqa"), tmp_path)
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:5000])
    with pytest.raises(CheckpointError, match="corrupt or truncated"):
        LLM(str(folder))


def test_truncated_gguf(default_gguf_path, tmp_path):
    bad = tmp_path / "bad.gguf"
    with default_gguf_path.open("rb") as f:
        bad.write_bytes(f.read(100_000))
    with pytest.raises(CheckpointError, match="not a readable GGUF"):
        LLM(str(bad))


def test_file_that_is_not_a_model(tmp_path):
    junk = tmp_path / "notes.txt"
    junk.write_text("hello")
    with pytest.raises(CheckpointError, match="neither a GGUF file nor a folder"):
        LLM(str(junk))


@pytest.mark.parametrize(
    "edit,message",
    [
        ("drop", "missing 1 of the model.s tensors: model.layers.1.self_attn.qkv_proj.weight \\(\\['k'\\]\\)"),
        ("extra", "'model.layers.0.mystery.weight' matches no parameter"),
        ("shape", "'model.norm.weight' has shape \\(63,\\), expected \\(64,\\)"),
    ],
)
def test_weights_must_match_exactly(tiny_model_dir, tmp_path, edit, message):
    folder = _copy(tiny_model_dir("llama_gqa"), tmp_path)
    tensors = load_file(folder / "model.safetensors")
    if edit == "drop":
        del tensors["model.layers.1.self_attn.k_proj.weight"]
    elif edit == "extra":
        tensors["model.layers.0.mystery.weight"] = tensors["model.norm.weight"].clone()
    else:
        tensors["model.norm.weight"] = tensors["model.norm.weight"][:63].clone()
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(WeightMismatchError, match=message):
        LLM(str(folder))


def test_prompt_longer_than_context(tiny_model_dir):
    llm = LLM(str(tiny_model_dir("llama_gqa")), kv_cache_memory=16 << 20)
    with pytest.raises(ValueError, match="context window is 256"):
        llm.generate([[5] * 300], SamplingParams(max_tokens=4))
    # the engine is still usable afterwards
    assert len(llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, ignore_eos=True))[0].outputs[0].token_ids) == 3


def test_generation_stops_at_context_end(tiny_model_dir):
    llm = LLM(str(tiny_model_dir("llama_gqa")), kv_cache_memory=16 << 20)
    out = llm.generate([[5] * 250], SamplingParams(max_tokens=100, ignore_eos=True))[0].outputs[0]
    assert len(out.token_ids) == 6 and out.finish_reason == "length"


def test_token_ids_outside_vocab(tiny_model_dir):
    llm = LLM(str(tiny_model_dir("llama_gqa")), kv_cache_memory=16 << 20)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate([[5, 100000]], SamplingParams())
    with pytest.raises(ValueError, match="logit_bias names token ids \\[9999\\]"):
        llm.generate([[5]], SamplingParams(logit_bias={9999: 1.0}))


@pytest.mark.parametrize(
    "field,value",
    [
        ("temperature", -0.1),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", -2),
        ("min_p", 1.5),
        ("repetition_penalty", 0.0),
        ("frequency_penalty", 3.0),
        ("presence_penalty", -2.5),
        ("max_tokens", 0),
        ("min_tokens", -1),
        ("n", 0),
        ("logprobs", -1),
        ("seed", "x"),
        ("stop", [""]),
        ("stop_token_ids", [-1]),
    ],
)
def test_invalid_sampling_params_name_the_field(field, value):
    with pytest.raises(ValueError, match=f"SamplingParams.{field} "):
        SamplingParams(**{field: value})


def test_min_tokens_above_max_tokens():
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=10, max_tokens=5)


def test_cli_reports_errors_without_traceback(capsys):
    assert cli_main(["generate", "--model", "/no/such/model", "hi"]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert cli_main(["generate", "--top-p", "7", "hi"]) == 2
    assert "SamplingParams.top_p" in capsys.readouterr().err


def test_chat_messages_must_have_role_and_content(smol_llm):
    with pytest.raises(ValueError, match="message 0 must be a dict with 'role' and 'content'"):
        smol_llm.chat([{"text": "hi"}])


def test_gpt2_style_vocab_and_merges_folder(tiny_model_dir, tmp_path):
    """Folders without tokenizer.json but with vocab.json + merges.txt still load."""
    import transformers

    folder = _copy(tiny_model_dir("gpt2"), tmp_path)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"))
    text = "The quick brown fox jumps"
    expected = fast(text).input_ids
    model = json.loads((folder / "tokenizer.json").read_text())["model"]
    (folder / "vocab.json").write_text(json.dumps(model["vocab"]))
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    (folder / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n")
    (folder / "tokenizer.json").unlink()
    llm = LLM(str(folder), kv_cache_memory=16 << 20)
    assert llm.tokenizer.encode(text) == expected


def test_request_larger_than_the_whole_cache_is_rejected_not_queued(tiny_model_dir):
    # 512 B per token (2 x 2 layers x 2 kv_heads x 16 x 4 B): 5 blocks of 16, one of them the null block
    llm = LLM(str(tiny_model_dir("llama_gqa")), kv_cache_memory=5 * 16 * 512)
    assert llm.engine.kv_cache_tokens == 64
    with pytest.raises(ValueError, match="needs up to 80 tokens of KV cache .* whole cache holds 64"):
        llm.generate([[5] * 40], SamplingParams(max_tokens=40))
    assert not llm.engine.has_unfinished_requests()
    out = llm.generate([[5] * 40], SamplingParams(max_tokens=20, ignore_eos=True))[0].outputs[0]
    assert len(out.token_ids) == 20
