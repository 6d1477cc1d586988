"""HF folders: config.json, one or more *.safetensors files, tokenizer files."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open


class CheckpointError(ValueError):
    """A checkpoint file is missing, corrupt, truncated or of an unknown kind."""


def read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"cannot read {path}: {e}") from e


def safetensors_files(folder: Path) -> list[Path]:
    """The weight files of an HF folder (the index's shards when there is an index)."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(read_json(index)["weight_map"].values()))
        files = [folder / n for n in names]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"shards named in {index.name} are missing: {', '.join(missing)}")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        hint = (
            " (PyTorch .bin checkpoints are not supported; convert to safetensors)" if any(folder.glob("*.bin")) else ""
        )
        raise CheckpointError(f"{folder} holds no *.safetensors weights{hint}")
    return files


def iter_safetensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor, read through safetensors' memory map one at a time."""
    for path in files:
        try:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                    yield name, f.get_tensor(name)
        except SafetensorError as e:
            raise CheckpointError(f"{path} is corrupt or truncated: {e}") from e


def hf_eos_ids(folder: Path, config: dict) -> set[int]:
    """EOS ids declared by config.json and generation_config.json."""
    ids: set[int] = set()
    sources = [config]
    gen = folder / "generation_config.json"
    if gen.is_file():
        sources.append(read_json(gen))
    for src in sources:
        eos = src.get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else [] if eos is None else [eos])
    return ids
