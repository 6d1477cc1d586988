"""The sampler chain through the engine on the real default model: greedy n-gram blocking and
bad words token-identical to HF transformers' generate(), DRY breaking a real loop, batched ==
alone and preempted == uninterrupted with every setting mixed, and the server's parameters."""

from __future__ import annotations

import httpx
import pytest
import torch

from tests.helpers.hf_reference import load_hf_reference
from tests.helpers.server_harness import ThreadedServer
from tokenloom import LLM, SamplingParams
from tokenloom.sampling.vocab import SamplingVocab

LOOPING = "My favorite things are"  # greedy SmolLM2-135M-Instruct repeats a whole line three times


def longest_repeat(ids: list[int]) -> int:
    """The length of the longest run of tokens that occurs twice (possibly overlapping)."""
    best = 0
    for length in range(1, len(ids)):
        seen = {tuple(ids[i : i + length]) for i in range(len(ids) - length + 1)}
        if len(seen) == len(ids) - length + 1:
            return best
        best = length
    return best


@pytest.fixture(scope="module")
def hf_model(default_model_dir):
    return load_hf_reference(default_model_dir)


@torch.no_grad()
def _hf_generate(model, prompt: list[int], new_tokens: int, **kwargs) -> list[int]:
    out = model.generate(
        torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False, num_beams=1, pad_token_id=0, **kwargs
    )
    return out[0, len(prompt) :].tolist()


def test_greedy_ngram_blocking_and_bad_words_equal_hf_generate(smol_llm, hf_model):
    tok = smol_llm.engine.tokenizer
    prompt = tok.encode(LOOPING)
    # each processor's tokens against transformers' generate with the same processor (plain greedy
    # parity: tests/models/test_parity_hf.py, and this model's GGUF in tests/loader/test_gguf.py)
    plain = smol_llm.generate([prompt], SamplingParams(temperature=0, max_tokens=48))[0].outputs[0].token_ids
    size = 3
    ours = smol_llm.generate([prompt], SamplingParams(temperature=0, max_tokens=48, no_repeat_ngram_size=size))
    ids = ours[0].outputs[0].token_ids
    assert ids == _hf_generate(hf_model, prompt, 48, no_repeat_ngram_size=size)
    ngrams = [tuple((prompt + ids)[i : i + size]) for i in range(len(prompt + ids) - size + 1)]
    assert len(set(ngrams)) == len(ngrams) and ids != plain
    words = ["favorite", "hobby or"]
    sequences = (
        SamplingVocab(tok, smol_llm.engine.model_config.vocab_size)
        .resolve(SamplingParams(bad_words=words))
        .bad_words_ids
    )
    ours = smol_llm.generate([prompt], SamplingParams(temperature=0, max_tokens=48, bad_words=words))[0].outputs[0]
    assert ours.token_ids == _hf_generate(hf_model, prompt, 48, bad_words_ids=sequences)
    assert "favorite" not in ours.text and "hobby or" not in ours.text
    assert "favorite" in tok.decode(plain) and "hobby or" in tok.decode(plain)


def test_dry_breaks_the_loop_greedy_decoding_falls_into(smol_llm):
    prompt = smol_llm.engine.tokenizer.encode(LOOPING)
    plain, dry, ngram = (
        smol_llm.generate([prompt], SamplingParams(temperature=0, max_tokens=80, **kw))[0].outputs[0]
        for kw in ({}, {"dry_multiplier": 0.8}, {"no_repeat_ngram_size": 3})
    )
    lines = [line for line in plain.text.splitlines() if line.strip()]
    assert len(lines) - len(set(lines)) >= 2  # the same line, again and again
    assert longest_repeat(plain.token_ids) >= 15
    assert longest_repeat(dry.token_ids) <= 8  # DRY: repeats of 2 are free, then costly
    assert longest_repeat(ngram.token_ids) <= 2  # no trigram twice


MIXED = [
    SamplingParams(temperature=0.8, top_k=30, dry_multiplier=0.8, seed=1, max_tokens=24),
    SamplingParams(temperature=0, no_repeat_ngram_size=2, bad_words=["the"], max_tokens=24),
    SamplingParams(typical_p=0.8, xtc_probability=0.5, xtc_threshold=0.1, seed=2, max_tokens=24),
    SamplingParams(mirostat=2, mirostat_tau=3.0, seed=3, max_tokens=24, ignore_eos=True),
    SamplingParams(
        top_n_sigma=1.0,
        epsilon_cutoff=3e-4,
        eta_cutoff=1e-3,
        samplers="top_k;top_p;temperature",
        top_p=0.9,
        repetition_penalty=1.2,
        repetition_penalty_range=8,
        seed=4,
        max_tokens=24,
    ),
    SamplingParams(mirostat=1, seed=5, max_tokens=24, ignore_eos=True, dry_multiplier=1.0),
]
PROMPTS = [LOOPING, "Once upon a time", "The three primary colors are", "def fib(n):", "Dear diary,", "1, 2, 3,"]


def test_mixed_settings_batched_equal_alone_and_preempted_equal_uninterrupted(default_model_dir, smol_llm):
    together = [o.outputs[0].token_ids for o in smol_llm.generate(PROMPTS, MIXED)]
    alone = [smol_llm.generate([p], [s])[0].outputs[0].token_ids for p, s in zip(PROMPTS, MIXED)]
    assert together == alone
    tiny = LLM(str(default_model_dir), kv_cache_memory=9 * 16 * 46080)  # 8 blocks of 16 tokens: preempts
    preempted = [o.outputs[0].token_ids for o in tiny.generate(PROMPTS, MIXED)]
    assert tiny.engine.core.scheduler.num_preemptions > 0
    assert preempted == together


# ---- the server ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def base_url(smol_llm):
    from tokenloom.engine.async_engine import AsyncLLMEngine
    from tokenloom.entrypoints.server import build_app

    with ThreadedServer(build_app(AsyncLLMEngine(smol_llm.engine), "smol")) as url:
        yield url


def _complete(base_url: str, **body) -> httpx.Response:
    return httpx.post(
        f"{base_url}/v1/completions", timeout=60, json={"prompt": LOOPING, "temperature": 0, "max_tokens": 48, **body}
    )


def test_server_takes_the_chain_under_vllm_and_llama_server_names(base_url, smol_llm):
    dry = _complete(base_url, dry_multiplier=0.8, dry_sequence_breakers=["\n"], explain=3).json()["choices"][0]
    want = smol_llm.generate(
        LOOPING, SamplingParams(temperature=0, max_tokens=48, dry_multiplier=0.8, dry_sequence_breakers=["\n"])
    )[0].outputs[0]
    assert dry["text"] == want.text
    assert any(step["num_moved"].get("dry") for step in dry["explain"])
    ngram = _complete(base_url, no_repeat_ngram_size=3, explain=2).json()["choices"][0]
    assert any(step["num_cut"].get("no_repeat_ngram") for step in ngram["explain"])
    assert (
        _complete(base_url, repeat_last_n=0, repetition_penalty=1.5).json()["choices"][0]["text"]
        == _complete(base_url).json()["choices"][0]["text"]
    )  # llama.cpp: 0 turns penalties off
    chat = httpx.post(
        f"{base_url}/v1/chat/completions",
        timeout=60,
        json={
            "messages": [{"role": "user", "content": "Name three fruits."}],
            "max_tokens": 12,
            "seed": 3,
            "mirostat": 2,
            "mirostat_tau": 4.0,
            "samplers": "top_k;typ_p;top_p;min_p;xtc;temperature",
            "typical_p": 0.9,
        },
    )
    assert chat.status_code == 200 and chat.json()["choices"][0]["message"]["content"]


@pytest.mark.parametrize(
    "body, param",
    [
        ({"typical_p": 0}, "typical_p"),
        ({"mirostat": 3}, "mirostat"),
        ({"dry_base": 0.5}, "dry_base"),
        ({"samplers": "top_k;bogus"}, "samplers"),
        ({"xtc_probability": 2.0}, "xtc_probability"),
        ({"no_repeat_ngram_size": -1}, "no_repeat_ngram_size"),
        ({"bad_words": ["x"] * 65}, "bad_words"),
        ({"repeat_last_n": -4}, "repeat_last_n"),
        ({"repeat_last_n": 8, "repetition_penalty_range": 8}, "repeat_last_n"),
        ({"dry_sequence_breakers": ["x" * 41], "dry_multiplier": 1.0}, "dry_sequence_breakers"),
        ({"mirostat": True}, "mirostat"),
    ],
)
def test_bad_chain_settings_are_400s_naming_the_parameter(base_url, body, param):
    r = _complete(base_url, **body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
