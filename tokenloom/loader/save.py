"""Saving a quantized model as a folder that loads again without re-quantizing (quant/checkpoint.py
describes the format)."""

from __future__ import annotations

from pathlib import Path

from safetensors.torch import save_file

from tokenloom.loader.load import load_model, write_folder_metadata
from tokenloom.quant.checkpoint import QUANT_METHOD
from tokenloom.quant.int8.modules import QuantizedLinear


def save_quantized(
    model_path: str | Path, folder: str | Path, quantization: str, progress: bool = True
) -> dict[str, str]:
    """Quantize a checkpoint and save it as a folder that loads again without re-quantizing.

    Returns module name -> format name of every quantized layer.
    """
    loaded = load_model(model_path, quantization=quantization, progress=progress, prepare=False)
    modules = {name: mod.fmt.name for name, mod in loaded.model.named_modules() if isinstance(mod, QuantizedLinear)}
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    state = {k: v.contiguous() for k, v in loaded.model.state_dict().items()}
    save_file(state, str(folder / "model.safetensors"))
    hf_config = dict(loaded.hf_config)
    hf_config["quantization_config"] = {"quant_method": QUANT_METHOD, "scheme": quantization, "modules": modules}
    write_folder_metadata(folder, hf_config, set(loaded.eos_token_ids), loaded.tokenizer, loaded.sampling_defaults)
    return modules
