"""A random-weight draft model for the speculative decoding tests and benchmarks/bench_spec.py (needs HF
transformers, a test/bench dependency only)."""

from __future__ import annotations

import shutil
from pathlib import Path


def save_random_draft(folder: Path, tokenizer_from: Path, vocab_size: int, seed: int = 0) -> Path:
    """A random-weight 2-layer Llama with another model's tokenizer files: a stand-in draft model
    that shares the target's tokenizer (and so is accepted by the draft proposer) but guesses badly."""
    import torch
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if (Path(tokenizer_from) / name).exists():
            shutil.copy(Path(tokenizer_from) / name, Path(folder) / name)
    return Path(folder)
