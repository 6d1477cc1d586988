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
    dtype: torch.dtype = torch.float32,
    **options,
) -> Path:
    """Save an adapter over `base` into `out`: LoraConfig(r, alpha, targets, **options), factors ~ N(0, std),
    stored as `dtype` (a bfloat16 file as adapters trained in bfloat16 are saved)."""
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
    if dtype != torch.float32:
        from safetensors.torch import load_file, save_file

        file = out / "adapter_model.safetensors"
        save_file({k: v.to(dtype) for k, v in load_file(str(file)).items()}, str(file))
    return out


def load_peft_reference(base: Path, adapter: Path):
    """transformers' model of `base` (eager attention, float32) with peft's adapter applied."""
    from peft import PeftModel

    from tests.helpers.hf_reference import load_hf_reference

    return PeftModel.from_pretrained(load_hf_reference(base), adapter).eval()


def write_gguf_adapter(base: Path, adapter: Path, path: Path, outtype: str = "F32") -> Path:
    """The PEFT folder `adapter` as llama.cpp's convert_lora_to_gguf.py writes it: general.type
    adapter, adapter.type lora, adapter.lora.alpha, `<base name>.lora_a` (r, in) and `.lora_b`
    (out, r) under the base's GGUF names, lora_b's q/k rows interleaved as the converter permutes
    a Llama base's (LoraTorchTensor.permute), F32 or F16."""
    import json
    import re

    import gguf
    import numpy as np
    from safetensors.torch import load_file

    from tests.helpers.gguf_writer import _BLOCK, GGUF_ARCH, llama_cpp_permute

    cfg = json.loads((base / "config.json").read_text())
    arch = GGUF_ARCH[cfg["architectures"][0]]
    lora = json.loads((adapter / "adapter_config.json").read_text())
    w = gguf.GGUFWriter(str(path), arch)
    w.add_type(gguf.GGUFType.ADAPTER)
    w.add_string(gguf.Keys.Adapter.TYPE, "lora")
    w.add_float32(gguf.Keys.Adapter.LORA_ALPHA, float(lora["lora_alpha"]))
    heads, kv_heads = cfg["num_attention_heads"], cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    dtype = np.float16 if outtype == "F16" else np.float32
    for name, tensor in sorted(load_file(str(adapter / "adapter_model.safetensors")).items()):
        layer, sub, which = re.fullmatch(
            r"base_model\.model\.model\.layers\.(\d+)\.(.+)\.lora_([AB])\.weight", name
        ).groups()
        if which == "B" and arch == "llama" and sub in ("self_attn.q_proj", "self_attn.k_proj"):
            tensor = llama_cpp_permute(tensor, heads if sub.endswith("q_proj") else kv_heads)
        w.add_tensor(f"blk.{layer}.{_BLOCK[sub]}.weight.lora_{which.lower()}", tensor.float().numpy().astype(dtype))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
