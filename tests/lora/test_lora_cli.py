"""`tokenloom generate --lora NAME=PATH` runs through the adapter it names."""

from __future__ import annotations

import pytest

pytest.importorskip("peft")

from tests.helpers.peft_adapters import make_peft_adapter
from tokenloom import LLM, SamplingParams
from tokenloom.entrypoints.cli.commands import main as cli_main

PROMPT = "The quick brown fox"


def test_generate_uses_the_adapter_it_is_given(tiny_model_dir, tmp_path, capsys):
    base = tiny_model_dir("llama_gqa")
    adapter = make_peft_adapter(base, tmp_path / "a", seed=31)
    llm = LLM(str(base), kv_cache_memory=16 << 20, lora={"a": str(adapter)})
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    with_adapter = llm.generate(PROMPT, greedy, lora="a")[0].outputs[0].text
    without = llm.generate(PROMPT, greedy)[0].outputs[0].text
    assert with_adapter != without
    flags = ["generate", "-m", str(base), "--temp", "0", "-n", "8", "--ignore-eos", "--kv-cache-memory", "0.02"]
    assert cli_main([*flags, "--lora", f"a={adapter}", PROMPT]) == 0
    assert capsys.readouterr().out.strip() == (PROMPT + with_adapter).strip()
    assert cli_main([*flags, "--lora", f"a={adapter}", "--lora", f"b={adapter}", PROMPT]) == 2
    assert "this command runs one adapter" in capsys.readouterr().err


def test_chat_replies_through_the_adapter_it_is_given(tiny_model_dir, tmp_path, monkeypatch, capsys):
    """`tokenloom chat --lora a=PATH`: each turn's reply is the adapter's greedy reply to the
    conversation, not the base model's."""
    import io
    import sys

    from tests.helpers.chat_model import marked_chat_model

    template = (
        "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}<|end|>{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    markers = ("<|user|>", "<|assistant|>", "<|system|>", "<|end|>")
    chat_model = marked_chat_model(tiny_model_dir("llama_gqa"), tmp_path / "chat", markers, template, ("<|end|>",))
    adapter = make_peft_adapter(chat_model, tmp_path / "a", seed=32)
    llm = LLM(str(chat_model), kv_cache_memory=16 << 20, lora={"a": str(adapter)})
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompt = llm.tokenizer.encode_chat([{"role": "user", "content": PROMPT}], add_generation_prompt=True)
    with_adapter = llm.generate([prompt], greedy, lora="a")[0].outputs[0].text
    without = llm.generate([prompt], greedy)[0].outputs[0].text
    assert with_adapter.strip() and with_adapter != without
    monkeypatch.setattr(sys, "stdin", io.StringIO(f"{PROMPT}\n/exit\n"))
    flags = ["chat", "-m", str(chat_model), "--temp", "0", "-n", "8", "--ignore-eos", "--kv-cache-memory", "0.02"]
    assert cli_main([*flags, "--lora", f"a={adapter}"]) == 0
    out = capsys.readouterr().out
    assert with_adapter.strip() in out and without.strip() not in out
