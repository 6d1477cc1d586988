"""A GGUF LoRA adapter, as llama.cpp's convert_lora_to_gguf.py writes it, read into LoRAFactors.

The file says ``general.type = adapter``, ``adapter.type = lora`` and ``adapter.lora.alpha``, and
holds ``<base tensor>.lora_a`` (r, in) and ``<base tensor>.lora_b`` (out, r) for each adapted
matrix, named as the base model's GGUF names it (``blk.0.attn_q.weight``), in the base's layout:
for Llama-architecture files lora_b's q/k rows are interleaved as the base's are, and undone here
as the loader undoes them for the base. Scaling is llama.cpp's: alpha / r (1 where alpha is 0).
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from tokenloom.loader.gguf import GGUFFile, unpermute_rope_rows
from tokenloom.lora.peft import LoRAFactors, PeftAdapter

_F16, _BF16 = 1, 30  # GGML type ids
_FACTOR = re.compile(r"(?P<base>.+)\.lora_(?P<which>[ab])")


def is_gguf(path: str | Path) -> bool:
    p = Path(path).expanduser()
    if not p.is_file():
        return False
    with p.open("rb") as f:
        return f.read(4) == b"GGUF"


def gguf_stored_dtype(path: str | Path) -> torch.dtype | None:
    """The dtype a GGUF adapter's factors are stored in (float32 for quantized blocks)."""
    g = GGUFFile(Path(path).expanduser())
    kinds = {t.type for t in g.tensors}
    return {frozenset({_F16}): torch.float16, frozenset({_BF16}): torch.bfloat16}.get(frozenset(kinds), torch.float32)


def read_gguf_adapter(path: str | Path, num_heads: int, num_kv_heads: int) -> PeftAdapter:
    """The adapter in GGUF file `path` for a model with these head counts (for q/k rows); ValueError
    for a file that is not a LoRA adapter or holds what tokenloom does not apply."""
    g = GGUFFile(Path(path).expanduser())
    if g.field("general.type") != "adapter" or g.field("adapter.type") != "lora":
        raise ValueError(f"{path} is not a GGUF LoRA adapter (general.type adapter, adapter.type lora)")
    if g.field("adapter.alora.invocation_tokens") is not None:
        raise ValueError(f"{path}: activated LoRA (adapter.alora.*) is not supported")
    alpha = float(g.field("adapter.lora.alpha", 0.0) or 0.0)
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for t in g.tensors:
        m = _FACTOR.fullmatch(t.name)
        if m is None:
            why = "adapters that change norms are not supported"
            raise ValueError(f"{path}: tensor {t.name!r} is not a LoRA factor ({why})")
        if m["base"].startswith(("token_embd.", "output.")):
            raise ValueError(f"{path}: LoRA on the embeddings and the output head is not supported ({t.name})")
        module = g.hf_name(m["base"]).removesuffix(".weight")
        pairs.setdefault(module, {})[m["which"]] = g.float_tensor(t)
    modules = {}
    for module, ab in pairs.items():
        if set(ab) != {"a", "b"}:
            raise ValueError(f"{path}: {module} has lora_{''.join(ab)} without its pair")
        A, B = ab["a"].float(), ab["b"].float()
        if A.shape[0] != B.shape[1]:
            raise ValueError(f"{path}: {module}'s lora_a {tuple(A.shape)} and lora_b {tuple(B.shape)} do not pair")
        if g.permutes_qk and module.endswith(("self_attn.q_proj", "self_attn.k_proj")):
            B = unpermute_rope_rows(B, num_heads if module.endswith("q_proj") else num_kv_heads)
        scaling = alpha / A.shape[0] if alpha else 1.0
        modules[module] = LoRAFactors(A.contiguous(), (B * scaling).contiguous())
    if not modules:
        raise ValueError(f"{path}: the adapter has no LoRA weights")
    return PeftAdapter(Path(path), modules, g.field("general.base_model.0.name"))
