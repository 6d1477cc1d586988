"""One sampling-defaults policy: the model's recommended settings (generation_config.json, or a GGUF
file's general.sampling.* keys), else llama.cpp's; applied to settings a request leaves out."""

from __future__ import annotations

import json
import shutil

import pytest

from tokenloom.sampling.defaults import FALLBACK, from_generation_config

LLAMA_CPP = {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05, "repetition_penalty": 1.0}


@pytest.mark.parametrize(
    "config,want",
    [
        (None, LLAMA_CPP),
        ({"bos_token_id": 1, "eos_token_id": [2]}, LLAMA_CPP),  # no sampling settings
        (
            {"do_sample": True, "temperature": 0.6, "top_p": 0.9},  # Llama 3's
            {"temperature": 0.6, "top_k": 0, "top_p": 0.9, "min_p": 0.0, "repetition_penalty": 1.0},
        ),
        (
            {"temperature": 0.7, "top_k": 20, "top_p": 0.8, "repetition_penalty": 1.05},  # Qwen2.5's
            {"temperature": 0.7, "top_k": 20, "top_p": 0.8, "min_p": 0.0, "repetition_penalty": 1.05},
        ),
        ({"do_sample": False}, {"temperature": 0.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "repetition_penalty": 1.0}),
    ],
)
def test_the_model_is_taken_at_its_word_else_llama_cpps_defaults(config, want):
    assert from_generation_config(config).values == want


def test_left_out_settings_are_filled_and_given_ones_kept():
    params = FALLBACK.params(temperature=0.0, top_k=None, seed=5, max_tokens=7)
    assert (params.temperature, params.top_k, params.top_p, params.min_p) == (0.0, 40, 0.95, 0.05)
    assert params.seed == 5 and params.max_tokens == 7


def _with_generation_config(src, dst, config):
    folder = shutil.copytree(src, dst)
    (folder / "generation_config.json").write_text(json.dumps(config))
    return folder


def test_an_hf_folders_generation_config_reaches_llm_and_the_server(tiny_model_dir, tmp_path):
    from tokenloom import LLM
    from tokenloom.entrypoints.server.protocol import CompletionRequest
    from tokenloom.sampling_params import SamplingParams

    folder = _with_generation_config(tiny_model_dir("llama_gqa"), tmp_path / "m", {"do_sample": False})
    llm = LLM(str(folder), kv_cache_memory=8 << 20)
    defaults = llm.engine.sampling_defaults
    assert defaults.values["temperature"] == 0.0 and defaults.source == "generation_config.json"
    greedy = llm.generate([5, 6, 7], SamplingParams(temperature=0, max_tokens=16))[0].outputs[0].token_ids
    assert llm.generate([5, 6, 7])[0].outputs[0].token_ids == greedy  # LLM without params: the model's
    request = CompletionRequest(model="m", prompt="x", top_p=0.5)
    params = request.sampling_params(8, None, defaults=defaults)
    assert (params.temperature, params.top_p) == (0.0, 0.5)  # the server: left out -> the model's


def test_a_gguf_files_sampling_keys_are_its_defaults(tiny_model_dir, tmp_path):
    from tests.helpers.gguf_writer import write_gguf
    from tokenloom.loader.load import load_checkpoint

    path = write_gguf(
        tiny_model_dir("llama_gqa"),
        tmp_path / "m.gguf",
        extra={"general.sampling.temp": 0.6, "general.sampling.top_k": 20},
    )
    defaults = load_checkpoint(path).sampling_defaults
    assert defaults.values == {
        "temperature": pytest.approx(0.6),
        "top_k": 20,
        "top_p": 1.0,
        "min_p": 0.0,
        "repetition_penalty": 1.0,
    }
    assert defaults.source == "the GGUF file"
    plain = write_gguf(tiny_model_dir("llama_gqa"), tmp_path / "plain.gguf")
    assert load_checkpoint(plain).sampling_defaults is FALLBACK
