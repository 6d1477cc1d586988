"""PEFT LoRA adapters with random non-zero factors over a tiny HF model, and peft's model as the
reference (PEFT initializes lora_B at zero, which would make every adapter the base model)."""

from __future__ import annotations

from pathlib import Path

import torch


def make_peft_adapter(
    base: Path,
    out: Path,
    r: int = 8,
    alpha: float = 16,
    targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
    seed: int = 0,
    std: float = 0.15,
    **options,
) -> Path:
    """Save an adapter over `base` into `out`: LoraConfig(r, alpha, targets, **options), factors ~ N(0, std)."""
    import transformers
    from peft import LoraConfig, get_peft_model

    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    config = LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets), lora_dropout=0.0, **options)
    peft_model = get_peft_model(model, config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=generator) * std)
    peft_model.save_pretrained(out)
    return out


def load_peft_reference(base: Path, adapter: Path):
    """transformers' model of `base` (eager attention, float32) with peft's adapter applied."""
    from peft import PeftModel

    from tests.helpers.hf_reference import load_hf_reference

    return PeftModel.from_pretrained(load_hf_reference(base), adapter).eval()
