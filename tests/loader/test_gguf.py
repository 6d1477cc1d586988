"""The real SmolLM2 GGUF against transformers loading the same GGUF, in float32."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.hf_reference import gguf_parsed_once, hf_greedy, load_hf_reference
from tokenloom import LLM, SamplingParams
from tokenloom.loader.gguf import GGUFFile, unpermute_rope_rows

NEW_TOKENS = 32


@pytest.fixture(scope="module")
def hf_gguf(default_gguf_path):
    transformers = pytest.importorskip("transformers")
    folder, name = default_gguf_path.parent, default_gguf_path.name
    with gguf_parsed_once():
        tok = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
        model = load_hf_reference(folder, gguf_file=name)
    return tok, model


@pytest.fixture(scope="module")
def gguf_llm(default_gguf_path):
    return LLM(str(default_gguf_path), dtype="float32", kv_cache_memory=64 << 20)


def test_greedy_matches_transformers_on_same_gguf(hf_gguf, gguf_llm):
    tok, model = hf_gguf
    chat = gguf_llm.tokenizer.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    prompts = [tok("Once upon a time, there was a little").input_ids, chat]
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)
    ours = gguf_llm.generate(prompts, params)
    for prompt, result in zip(prompts, ours):
        ref = hf_greedy(model, prompt, NEW_TOKENS)
        out = result.outputs[0]
        assert out.token_ids == ref.tokens
        got = [lp[t] for lp, t in zip(out.logprobs, out.token_ids)]
        assert got == pytest.approx(ref.logprobs, abs=1e-4)


def test_known_answers(gguf_llm):
    greedy = SamplingParams(temperature=0, max_tokens=12)
    story = gguf_llm.generate("Once upon a time, there was a little", greedy)[0].outputs[0].text
    assert story.startswith(" girl named Emma who loved to play in the sun.")
    answer = gguf_llm.chat([{"role": "user", "content": "What is the capital of France?"}], greedy)[0].outputs[0]
    assert answer.text == "The capital of France is Paris."
    assert answer.finish_reason == "stop" and answer.stop_reason == 2  # <|im_end|>, the declared EOS


def test_prepared_folder_generates_like_the_gguf(default_model_dir, gguf_llm, smol_llm):
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompt = "The three primary colors are"
    assert (
        smol_llm.generate(prompt, params)[0].outputs[0].token_ids
        == gguf_llm.generate(prompt, params)[0].outputs[0].token_ids
    )


@pytest.mark.parametrize(
    "text",
    [
        "Once upon a time, there was a little",
        "   leading spaces and 3.14159 digits",
        "don't I'll WE'VE they're",
        "ünïcödé — “quotes” 😀 日本語",
        "<|im_start|>user\nhi there<|im_end|>\n",
        "tabs\tand\nnewlines\n",
    ],
)
def test_tokenizer_matches_transformers(hf_gguf, gguf_llm, text):
    tok, _ = hf_gguf
    assert gguf_llm.tokenizer.encode(text) == tok(text).input_ids
    assert gguf_llm.tokenizer.decode(tok(text).input_ids, skip_special_tokens=False) == text


def test_digits_split_like_llama_cpp(gguf_llm):
    # llama.cpp's `smollm` pre-tokenizer isolates every digit first, then applies the
    # GPT-2 regex to the rest, like SmolLM2's own tokenizer.json (Digits + ByteLevel):
    # whitespace before a digit stays one piece.
    tk = gguf_llm.tokenizer
    ids = tk.encode("x\n\n  12")
    assert [tk.decode([i], skip_special_tokens=False) for i in ids] == ["x", "\n\n  ", "1", "2"]


def test_chat_template_matches_transformers(hf_gguf, gguf_llm):
    tok, _ = hf_gguf
    msgs = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "2+2?"},
    ]
    assert gguf_llm.tokenizer.apply_chat_template(msgs) == tok.apply_chat_template(
        msgs, tokenize=False, add_generation_prompt=True
    )


def test_unpermute_inverts_llama_cpp_permutation():
    # llama.cpp's convert_hf_to_gguf.py permute(), written out here as the oracle.
    def permute(w, n_head):
        return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    w = torch.randn(3 * 8, 5)
    assert torch.equal(unpermute_rope_rows(permute(w, 3), 3), w)
    assert not torch.equal(permute(w, 3), w)


def test_gguf_config_reads_metadata(default_gguf_path):
    cfg = GGUFFile(default_gguf_path).hf_config()
    assert (
        cfg["num_hidden_layers"],
        cfg["hidden_size"],
        cfg["num_attention_heads"],
        cfg["num_key_value_heads"],
        cfg["vocab_size"],
    ) == (30, 576, 9, 3, 49152)
    assert cfg["rope_theta"] == 100000.0 and cfg["tie_word_embeddings"] is True


def test_a_split_gguf_loads_as_one_file_from_its_first_shard(tiny_model_dir, tmp_path):
    """llama.cpp's gguf-split shards (NAME-0000i-of-0000N.gguf) side by side: the same model as the
    whole file; another shard, or a shard missing, is an error naming what to do."""
    from tests.helpers.gguf_writer import write_gguf
    from tokenloom.loader.safetensors import CheckpointError

    folder = tiny_model_dir("llama_gqa")
    whole = write_gguf(folder, tmp_path / "m.gguf", quantize="Q8_0")
    first = write_gguf(folder, tmp_path / "m-Q8_0.gguf", quantize="Q8_0", split_max_tensors=8)
    assert first.name == "m-Q8_0-00001-of-00003.gguf"  # 21 tensors, 8 a shard
    names = [[t.name for t in GGUFFile(p).tensors] for p in (first, whole)]
    assert names[0] == names[1] and len(names[0]) == 21
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    runs = [
        LLM(str(p), kv_cache_memory=8 << 20).generate(["hello there"], params)[0].outputs[0] for p in (first, whole)
    ]
    assert runs[0].token_ids == runs[1].token_ids
    with pytest.raises(CheckpointError, match=r"one shard of a split GGUF of 3: open its first shard"):
        GGUFFile(tmp_path / "m-Q8_0-00002-of-00003.gguf")
    (tmp_path / "m-Q8_0-00003-of-00003.gguf").unlink()
    with pytest.raises(CheckpointError, match=r"split in 3 shards and m-Q8_0-00003-of-00003.gguf is missing"):
        GGUFFile(first)
